"""Renders every command's flags as Markdown (docs/flags.md is this output; a test keeps it current).

    python -m splitspec.flagdoc > docs/flags.md
"""

from __future__ import annotations

import argparse

from splitspec.cli import COMMANDS, load_command


def _flag_cell(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}`"
    if action.nargs != 0 and action.option_strings:
        names += f" {action.metavar or action.dest.upper()}"
    return names


def _default_cell(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default is None or action.default is False or action.default is argparse.SUPPRESS or action.default == []:
        return ""
    return f"`{action.default}`"


def render() -> str:
    lines = ["# Command-line flags", "", "Generated from the parsers by `python -m splitspec.flagdoc`; do not edit.", ""]
    for name, (_, summary) in COMMANDS.items():
        parser = load_command(name).build_parser()
        lines += [f"## `splitspec {name}`", "", summary + ".", "", "| flag | default | meaning |", "|---|---|---|"]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            choices = f" One of: {', '.join(map(str, action.choices))}." if action.choices else ""
            lines.append(f"| {_flag_cell(action)} | {_default_cell(action)} | {action.help}{choices} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")

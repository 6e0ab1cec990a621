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


def _parser_section(title: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `{title}`", "", summary.rstrip(".") + ".", ""]
    rows, subcommands = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            subcommands += [(f"{title} {name}", helps.get(name, ""), sub) for name, sub in action.choices.items()]
            continue
        choices = f" One of: {', '.join(map(str, action.choices))}." if action.choices else ""
        help_text = action.help.replace("%%", "%")  # argparse's escape, as --help prints it
        rows.append(f"| {_flag_cell(action)} | {_default_cell(action)} | {help_text}{choices} |")
    if rows:
        lines += ["| flag | default | meaning |", "|---|---|---|", *rows, ""]
    for sub_title, sub_summary, sub in subcommands:
        lines += _parser_section(sub_title, sub_summary, sub)
    return lines


def render() -> str:
    lines = ["# Command-line flags", "", "Generated from the parsers by `python -m splitspec.flagdoc`; do not edit.", ""]
    for name, (_, summary) in COMMANDS.items():
        lines += _parser_section(f"splitspec {name}", summary, load_command(name).build_parser())
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")

"""The one `splitspec` command: argv[1] names the service or tool, the rest are its flags.

Each command lives in its own module with `build_parser()` and `run(args) -> int`; this file only
dispatches, so `splitspec <cmd> --help` is that command's parser and nothing is imported that the
command does not need (the gateway never imports torch). A service whose module imports torch keeps
its flags in a module of their own (FLAGS): the flags are parsed before the service is imported, so
`--help` and a misspelt flag answer at once.
"""

from __future__ import annotations

import faulthandler
import importlib
import signal
import sys

# command name -> (module, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("splitspec.launcher", "gateway + verifier + drafters as local processes (the compose topology), demo models by default"),
    "gateway": ("splitspec.gateway.server", "OpenAI-compatible HTTP in front of a verifier (never imports torch)"),
    "generate": ("splitspec.generate", "offline generation in one process, plain decoding"),
    "verifier": ("splitspec.verifier_svc.server", "the target model and step loop behind the gRPC API"),
    "drafter": ("splitspec.drafter_svc.server", "one drafting algorithm serving a verifier's pool over ZeroMQ"),
    "bench": ("splitspec.bench", "speculative decoding measured over a grid of batch size x tree shape, in process or against a deployment"),
    "demo-models": ("splitspec.demo", "print (building if needed) the demo target and draft directories"),
    "zmq-keys": ("splitspec.zmq_keys", "CURVE key pairs that encrypt and authenticate the verifier-drafter step channel"),
    "train": ("splitspec.train.cli", "train models: `train lm` (tokenizer + causal LM from scratch), `train eagle|eagle3` (draft heads)"),
}

# command name -> the module of its build_parser(), where that is not the command's module (which imports torch)
FLAGS: dict[str, str] = {
    "generate": "splitspec.generate_flags",
    "verifier": "splitspec.verifier_svc.flags",
    "drafter": "splitspec.drafter_svc.flags",
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: splitspec <command> [flags]   (splitspec <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def load_command(name: str):
    """The module implementing `name` (has build_parser() and run(args))."""
    module_name, _ = COMMANDS[name]
    return importlib.import_module(module_name)


def load_flags(name: str):
    """The module of `name`'s build_parser(): its flags module (FLAGS) or else the command's own."""
    return importlib.import_module(FLAGS.get(name, COMMANDS[name][0]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from splitspec import __version__

        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"splitspec: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from splitspec.default_model import set_provider

    set_provider(_demo_target)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack: where a stuck service waits
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # `kill -USR2`: the gateway, the gRPC front and `bench --url` print their event loops' tasks
        # (event_loop.print_tasks_on_sigusr2); every other command ignores it rather than die of it
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    flags_module = load_flags(name)
    parser = flags_module.build_parser()
    flags = argv[1:] + _sglang_env_flags(parser)
    if getattr(flags_module, "PASS_THROUGH", False):  # `up`: flags it does not know go on to the services
        args, rest = parser.parse_known_args(flags)
        args.passthrough = rest
    else:
        args = parser.parse_args(flags)  # --help and a bad flag end here, before the command's module loads
    return load_command(name).run(args)


def _demo_target():
    """The default --model-path (splitspec.default_model): the demo target, built first if it must be."""
    from splitspec.demo import demo_model_dirs

    return demo_model_dirs()["target"]


def _sglang_env_flags(parser) -> list[str]:
    """SGLang's environment switches, read here once and passed on as the flags they stand for."""
    import os

    flags = []
    known = {option for action in parser._actions for option in action.option_strings}
    force_greedy = os.environ.get("SGLANG_NGRAM_FORCE_GREEDY_VERIFY", "").lower() in ("1", "true", "yes")
    if force_greedy and "--speculative-ngram-force-greedy-verify" in known:
        flags.append("--speculative-ngram-force-greedy-verify")
    return flags

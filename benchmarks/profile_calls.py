"""Where named functions' time goes: `splitspec bench` in this process under cProfile, then each named function's
callees (calls, own and cumulative seconds) and the functions whose own time is largest.

    python -P benchmarks/profile_calls.py --functions _forward graphs.run --bench-args --speculative-algorithm NGRAM \
        --num-draft-tokens 12 --batch-size 16 --num-prompts 32 --device cuda --dtype bfloat16

host_cost.py times pieces named in advance; this finds what a piece's own time is made of when host_cost cannot place it
(cProfile's overhead inflates every call, short ones most: compare callees with each other, not with host_cost's figures).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--functions", nargs="+", default=["_forward"],
                        help="Regular expressions of the functions whose callees are printed (pstats' restrictions).")
    parser.add_argument("--top", type=int, default=30, help="Functions listed by own time.")
    parser.add_argument("--bench-args", nargs=argparse.REMAINDER, default=[],
                        help="The rest of the command line goes to `splitspec bench`.")
    args = parser.parse_args()
    from splitspec import cli

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        sys.argv = ["splitspec", "bench", "--no-phase-sync", "--log-level", "warning", *args.bench_args, "--out", out.name]
        profile = cProfile.Profile()
        with contextlib.redirect_stdout(io.StringIO()):
            profile.enable()
            cli.main()
            profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(args.top)
    for name in args.functions:
        stats.sort_stats("cumulative").print_callees(name)


if __name__ == "__main__":
    main()

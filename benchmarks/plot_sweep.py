"""The batch sweep of `splitspec bench` as a plot and a summary: output tok/s against batch size for plain
decoding, each fixed tree and load-adaptive speculation, one panel per acceptance profile.

    python benchmarks/plot_sweep.py SWEEP.json [--png sweep.png] [--summary summary.json]

The summary gives, per profile and series, the speedup over plain at every batch size and its minimum (the
issue's target: >= 0.98 everywhere), from the rows as measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def series_of(row: dict) -> str:
    if not row.get("speculative"):
        return "plain"
    tree = f"steps {row['steps']} topk {row['topk']} tokens {row['num_draft_tokens']}"
    return f"adaptive (up to {tree})" if row.get("adaptive") else f"fixed {tree}"


def summarize(report: dict) -> dict:
    """{profile: {series: {"tok_s": {bs: x}, "speedup": {bs: x}, "min_speedup": x}}}; plain under every profile."""
    rows = report["rows"]
    plain = {r["batch_size"]: r["output_tok_s"] for r in rows if not r.get("speculative")}
    out: dict = defaultdict(dict)
    for row in rows:
        if not row.get("speculative"):
            continue
        profile = row.get("profile") or "real acceptance"
        entry = out[profile].setdefault(series_of(row), {"tok_s": {}, "speedup": {}, "accept_length": {}, "budgets": {}})
        bs = row["batch_size"]
        entry["tok_s"][bs] = row["output_tok_s"]
        entry["speedup"][bs] = round(row["output_tok_s"] / plain[bs], 3) if plain.get(bs) else None
        entry["accept_length"][bs] = row.get("accept_length")
        if row.get("budgets"):
            entry["budgets"][bs] = row["budgets"]
    for profile in out.values():
        for entry in profile.values():
            values = [v for v in entry["speedup"].values() if v is not None]
            entry["min_speedup"] = min(values) if values else None
        profile["plain"] = {"tok_s": plain}
    return dict(out)


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = list(summary)
    fig, axes = plt.subplots(1, len(profiles), figsize=(6.5 * len(profiles), 4.8), squeeze=False)
    for ax, profile in zip(axes[0], profiles):
        for name, entry in sorted(summary[profile].items(), key=lambda kv: (kv[0] != "plain", kv[0])):
            points = sorted((int(bs), v) for bs, v in entry["tok_s"].items())
            style = {"plain": dict(color="black", linewidth=2.2, marker="o")}.get(name, {})
            if name.startswith("adaptive"):
                style = dict(linewidth=2.2, marker="s", linestyle="-")
            elif name != "plain":
                style = dict(linewidth=1.2, marker=".", linestyle="--")
            ax.plot([p[0] for p in points], [p[1] for p in points], label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (requests running at once)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"acceptance: {profile}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="A `splitspec bench --out` JSON with several batch sizes.")
    parser.add_argument("--png", default=None, help="Where to write the plot (needs matplotlib: pip install splitspec[plot]).")
    parser.add_argument("--summary", default=None, help="Also write the summary JSON here (else stdout).")
    args = parser.parse_args(argv)
    report = json.loads(Path(args.sweep).read_text())
    summary = summarize(report)
    if not summary:
        print(f"{args.sweep}: no speculative rows to plot", file=sys.stderr)
        return 1
    if args.png:
        plot(summary, Path(args.png), f"{report.get('model', '')} on {report.get('device', '')}"[:140])
    text = json.dumps({"source": args.sweep, "device": report.get("device"), "profiles": summary}, indent=1)
    if args.summary:
        Path(args.summary).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

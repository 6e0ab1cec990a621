"""Sums up scripts/gpu_bench.sh's split stage: `python3 scripts/split_summary.py DIR [TAG]` reads
DIR/split{TAG}_<mode>.json (one `splitspec bench` report per mode) and prints one JSON object: per mode the
speculative row (tok/s, speedup over plain decoding, accept length, step phases, bets, greedy outputs equal
to plain), and issue 14's ratios:

    zmq_cost                 1 - colocated / inprocess           (the drafter behind ZeroMQ, same GPU, no overlap)
    split_overlap_speedup    split_overlap / inprocess           (split with overlap vs co-located without)
    system_efficiency        per-request tok/s / (accept length / verify ms) of the split_overlap run: the
                             share of the tokens its own verify passes could deliver if nothing else took time
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODES = ("inprocess", "colocated", "colocated_overlap", "split", "split_overlap")


def main() -> None:
    directory, tag = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""
    modes = {}
    for mode in MODES:
        path = directory / f"split{tag}_{mode}.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        plain = next(r for r in report["rows"] if r["speculative"] is None)
        row = next(r for r in report["rows"] if r["speculative"] is not None)
        modes[mode] = {k: row.get(k) for k in ("output_tok_s", "per_request_tok_s", "speedup", "accept_length", "step_ms",
                                               "fallbacks", "outputs_equal_plain", "drafter_transport", "drafter_device",
                                               "overlap", "num_bets", "bets", "steps", "topk", "num_draft_tokens", "drafter_reply_ms",
                                               "drafter_bets_ms", "round_trip_ms", "transport_ms")}
        modes[mode]["plain_output_tok_s"] = plain["output_tok_s"]
        modes[mode]["device"] = report["device"]
    out = {"modes": modes}

    def tok_s(mode):
        return modes[mode]["output_tok_s"] if mode in modes else None

    if tok_s("inprocess") and tok_s("colocated"):
        out["zmq_cost"] = round(1 - tok_s("colocated") / tok_s("inprocess"), 4)
    if tok_s("inprocess") and tok_s("split_overlap"):
        out["split_overlap_speedup"] = round(tok_s("split_overlap") / tok_s("inprocess"), 4)
    if tok_s("colocated") and tok_s("split_overlap"):
        out["split_overlap_vs_colocated_zmq"] = round(tok_s("split_overlap") / tok_s("colocated"), 4)
    best = modes.get("split_overlap")
    if best and best.get("accept_length") and best.get("step_ms") and best["step_ms"].get("verify"):
        ideal = best["accept_length"] / best["step_ms"]["verify"] * 1000
        out["system_efficiency"] = round(best["per_request_tok_s"] / ideal, 4)
        out["ideal_tok_s_from_verify"] = round(ideal, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# An in-process A/B on one machine: `splitspec bench` with the same flags, alternately with this checkout's code
# ("new") and with it but for the files an overlay folder holds ("old"; scripts/ab_tree.sh), round after round, so
# that both sides meet the same minutes of a lent VM's changing host speed. After scripts/gpu_env.sh:
#   git show C:path > ab_old/path ...   (here, for every file changed since commit C)
#   AB_OVERLAY=ab_old AB_ROUNDS=2 AB_FLAGS='--device cuda ... --batch-size 32,64' OUT=/tmp/ab bash benchmarks/ab_in_process.sh
# Writes OUT/ab_summary.json: per side and round, each row's batch size, drafter, output tok/s and step ms.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${AB_OVERLAY:?a folder holding the old side files}" "${AB_FLAGS:?splitspec bench flags}" "${OUT:?}"
mkdir -p "$OUT"
site="${AB_SITE:-/tmp/site}"
new=$(bash scripts/import_tree.sh /tmp/ab-new)
old=$(bash scripts/ab_tree.sh "$AB_OVERLAY" /tmp/ab-old)
for round in $(seq 1 "${AB_ROUNDS:-2}"); do
    for side in old new; do
        tree=$new && [[ $side == old ]] && tree=$old
        # shellcheck disable=SC2086 # AB_FLAGS is a flag list
        PYTHONPATH="$tree:$site" timeout "${AB_STEP_TIMEOUT:-180}" python3 -P -m splitspec bench $AB_FLAGS \
            --out "$OUT/ab_${side}_$round.json" > "$OUT/ab_${side}_$round.log" 2>&1 \
            || { echo "ab: $side round $round failed"; tail -5 "$OUT/ab_${side}_$round.log"; }
    done
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = []
for path in sorted(out.glob("ab_*_*.json")):
    side, rnd = path.stem.split("_")[1:]
    rows = json.loads(path.read_text()).get("rows", [])
    runs.append({"side": side, "round": int(rnd), "rows": [
        {k: r.get(k) for k in ("batch_size", "speculative", "output_tok_s", "accept_length")} | {"step_ms": (r.get("step_ms") or {}).get("total")}
        for r in rows]})
(out / "ab_summary.json").write_text(json.dumps(runs, indent=1))
for run in runs:
    print(run["side"], run["round"], [(r["batch_size"], r["speculative"], r["output_tok_s"], r["step_ms"]) for r in run["rows"]])
PY

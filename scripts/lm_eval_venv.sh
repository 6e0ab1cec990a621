#!/usr/bin/env bash
# bash scripts/lm_eval_venv.sh DIR [PYTHON]: a virtualenv at DIR with lm-eval-harness (its API models, from PyPI) and
# PYTHON's transformers version, for tests/test_lm_eval.py and tests/test_serving_benchmarks.py; DIR/.ready when it is done, DIR/.failed when not (the
# pip log is DIR.log). .ci/run starts it in the background so the download overlaps the test suite; the test runs
# it itself when no such virtualenv is named (SPLITSPEC_LM_EVAL_VENV).
set -uo pipefail
DIR="$1"
PY="${2:-python3}"
LM_EVAL="lm-eval[api]==0.4.13"
# vLLM's benchmarks/benchmark_serving.py (tests/test_serving_benchmarks.py) imports PIL besides what lm-eval brings
PILLOW="pillow>=10"
rm -rf "$DIR"
TRANSFORMERS="$("$PY" -c "import transformers; print(transformers.__version__)" 2>/dev/null || true)"
if { "$PY" -m venv "$DIR" && "$DIR/bin/python" -m pip install -q --disable-pip-version-check --no-compile "$LM_EVAL" "$PILLOW" \
        ${TRANSFORMERS:+"transformers==$TRANSFORMERS"}; } > "$DIR.log" 2>&1; then
    touch "$DIR/.ready"
else
    mkdir -p "$DIR" && touch "$DIR/.failed"
fi

#!/usr/bin/env bash
# Source on the GPU machine from the repo root: installs the carried wheels (.whl/) into /tmp/site and
# puts them and the mapped splitspec package on PYTHONPATH.
#   . scripts/gpu_env.sh
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
fi
export PYTHONPATH="$(bash scripts/import_tree.sh):/tmp/site" PYTHONUNBUFFERED=1
if [[ -f .whl/prometheus.gz ]]; then
    mkdir -p /tmp/bin && gunzip -c .whl/prometheus.gz > /tmp/bin/prometheus && chmod +x /tmp/bin/prometheus
    export PATH="/tmp/bin:$PATH" SPLITSPEC_REQUIRE_PROMETHEUS=1
fi

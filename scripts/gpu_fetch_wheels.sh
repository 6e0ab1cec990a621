#!/usr/bin/env bash
# Downloads the wheels of scripts/gpu_wheels.txt into .whl/ (git-ignored) for the GPU image (Python 3.12,
# manylinux x86_64). A device call carries .whl and starts with scripts/gpu_env.sh, which installs them.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
PY="${PYTHON:-python3}"
grep -v '^#' "$REPO/scripts/gpu_wheels.txt" | grep -v '^$' | while read -r spec; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$REPO/.whl" "$spec"
done
ls "$REPO/.whl"
# The GPU image has no Prometheus server: carry this machine's (Debian's prometheus package, a Go
# binary linked only against libc) so the metrics tests run there too.
if command -v prometheus >/dev/null; then
    gzip -9 -c "$(command -v prometheus)" > "$REPO/.whl/prometheus.gz"
fi

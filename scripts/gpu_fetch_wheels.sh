#!/usr/bin/env bash
# Downloads the wheels of scripts/gpu_wheels.txt into .whl/ and .fi/ (git-ignored) for the GPU image (Python 3.12,
# manylinux x86_64). A device call carries .whl and starts with scripts/gpu_env.sh, which installs them.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
PY="${PYTHON:-python3}"
# Lines "fi: SPEC" go to .fi/ (the kernels' carry), the others to .whl/ (the services').
grep -v '^#' "$REPO/scripts/gpu_wheels.txt" | grep -v '^$' | while read -r spec; do
    dest="$REPO/.whl"
    if [[ "$spec" == fi:* ]]; then dest="$REPO/.fi"; spec="${spec#fi: }"; fi
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "$spec"
done
ls "$REPO/.whl" "$REPO/.fi"
# The GPU image has no Prometheus server: carry this machine's (Debian's prometheus package, a Go
# binary linked only against libc) so the metrics tests run there too.
if command -v prometheus >/dev/null; then
    gzip -9 -c "$(command -v prometheus)" > "$REPO/.whl/prometheus.gz"
fi

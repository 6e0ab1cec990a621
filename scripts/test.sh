#!/usr/bin/env bash
# The test command: `bash scripts/test.sh [pytest args...]`.
#
# Sets up the venv (scripts/setup.sh), then runs `python -P -m pytest tests --durations=25 "$@"` from
# the repo root, on SPLITSPEC_TEST_WORKERS pytest-xdist workers (default 4: the end-to-end tests wait on their services much of
# the time, so four workers fill two cores; 0 runs in this process), one test
# file per worker at a time (--dist loadfile: a file's module-scoped deployments start once). -P keeps the repo root off sys.path (its gateway/, kernels/, protos/ folders must not
# be importable as top-level packages; ARCHITECTURE.md §7). When an argument already names a test path
# (a file or folder relative to the repo root, or a node id with ::), `tests` is not added, so
# `bash scripts/test.sh tests/test_packaging.py` runs just that file.
# Fails loudly: any nonzero pytest exit propagates, and exit 5 (no tests collected) becomes a failure.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
VENV="${SPLITSPEC_VENV:-$REPO/.venv}"

bash "$REPO/scripts/setup.sh"

cd "$REPO"
targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* ]] && { [[ "$arg" == *::* ]] || [[ -e "$arg" ]]; }; then
        targets=()
        break
    fi
done

# One torch (OpenMP) thread per process: the tests' models are tiny, so a second thread buys ~10% of a file's
# time for ~75% more CPU, and with two workers, each starting services, the extra threads only fight for the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers=(-n "${SPLITSPEC_TEST_WORKERS:-4}" --dist loadfile --no-loadscope-reorder)  # files in collection order: conftest puts the slow ones first
[[ "${SPLITSPEC_TEST_WORKERS:-4}" == 0 ]] && workers=(-p no:xdist)
echo "test.sh: $VENV/bin/python -P -m pytest ${targets[*]} ${workers[*]} --durations=25 $*" >&2
set +e
"$VENV/bin/python" -P -m pytest "${targets[@]}" "${workers[@]}" --durations=25 "$@"
rc=$?
set -e

if [[ $rc -eq 5 ]]; then
    echo "test.sh: ERROR: pytest collected no tests (exit code 5); treating that as a failure." >&2
    exit 1
elif [[ $rc -ne 0 ]]; then
    echo "test.sh: ERROR: pytest failed with exit code $rc." >&2
fi
exit "$rc"

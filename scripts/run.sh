#!/usr/bin/env bash
# The main command: `bash scripts/run.sh <command> [flags]`, e.g. `bash scripts/run.sh generate ...`.
# Sets up the venv (scripts/setup.sh, quiet and on stderr), then runs the `splitspec` console script
# in the caller's directory, so relative paths in the flags mean what the caller expects.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
VENV="${SPLITSPEC_VENV:-$REPO/.venv}"

bash "$REPO/scripts/setup.sh"
exec "$VENV/bin/splitspec" "$@"

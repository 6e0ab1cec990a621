#!/usr/bin/env bash
# Idempotent set-up of the project's virtualenv; safe to run from any directory, and cheap to re-run.
#
#   SPLITSPEC_VENV  where the venv lives            (default: <repo>/.venv)
#   PYTHON          interpreter that creates it     (default: python3; Python >= 3.11)
#   SPLITSPEC_TORCH torch requirement installed first (default: torch==2.13.0, the CPU wheel on our
#                   machines; installing the project first would make pip pull a multi-GB CUDA build)
#   SPLITSPEC_TORCH_INDEX  an index for torch only, e.g. https://download.pytorch.org/whl/cpu for the
#                   CPU build on a Linux machine whose pip would otherwise take PyPI's CUDA build
#
# A stamp file inside the venv records a hash of pyproject.toml and the repo path; when it matches
# (and splitspec is still installed), nothing is installed. Everything goes to stderr, so that
# `scripts/run.sh ... --json` keeps a clean stdout.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
VENV="${SPLITSPEC_VENV:-$REPO/.venv}"
PY="${PYTHON:-python3}"
TORCH_REQ="${SPLITSPEC_TORCH:-torch==2.13.0}"
STAMP="$VENV/.splitspec-setup-stamp"
VPY="$VENV/bin/python"

log() { printf 'setup.sh: %s\n' "$*" >&2; }
die() { printf 'setup.sh: ERROR: %s\n' "$*" >&2; exit 1; }
# --no-compile: pip byte-compiles one file at a time; compileall below does the whole venv on every core.
pip_q() { "$VPY" -m pip --disable-pip-version-check -q "$@" --no-compile >&2; }

# One set-up at a time per venv (test.sh and run.sh may race on a fresh checkout).
mkdir -p "$VENV"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV/.splitspec-setup.lock"
    flock 9
fi

want="$(
    {
        sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1
        printf 'repo=%s\ntorch=%s\n' "$REPO" "$TORCH_REQ"
    }
)"

if [[ -x "$VPY" ]] && [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$want" ]] \
    && "$VPY" -I -c 'import importlib.metadata as m; m.version("splitspec")' >/dev/null 2>&1; then
    exit 0  # up to date
fi

# (Re)create the venv if it is missing or its interpreter no longer runs.
if ! [[ -x "$VPY" ]] || ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter '$PY' (set PYTHON=...)"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PY is $("$PY" -V 2>&1); splitspec needs Python >= 3.11 (set PYTHON=...)"
    log "creating virtualenv $VENV with $("$PY" -V 2>&1)"
    "$PY" -m venv --clear "$VENV" >&2
    # --clear emptied the folder: take the lock again on a fresh file.
    if command -v flock >/dev/null 2>&1; then
        exec 9>"$VENV/.splitspec-setup.lock"
        flock 9
    fi
fi

log "upgrading pip and setuptools in $VENV"
# setuptools >= 77 in the venv lets tests build the project offline (--no-build-isolation);
# pyproject's license = "Apache-2.0" needs it.
pip_q install --upgrade pip "setuptools>=77"

if "$VPY" - >/dev/null 2>&1 <<'PYEOF'
import sys
import torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if v >= (2, 11) else 1)
PYEOF
then
    log "torch $("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null) already installed"
else
    log "installing $TORCH_REQ (before the project, so pip does not pull a CUDA build)"
    if [[ -n "${SPLITSPEC_TORCH_INDEX:-}" ]]; then
        pip_q install "$TORCH_REQ" --index-url "$SPLITSPEC_TORCH_INDEX"
    else
        pip_q install "$TORCH_REQ"
    fi
fi

log "installing splitspec (editable) with test extras from $REPO"
pip_q install --no-build-isolation -e "$REPO[test]"  # the venv's setuptools builds it: no build venv to make

# Byte-compiled once here, in parallel: with PYTHONDONTWRITEBYTECODE set (as on our CI machines) a module
# without its .pyc is compiled again by every process that imports it (torch's import alone: 2 s -> 6 s).
log "byte-compiling the virtualenv's packages"
"$VPY" -m compileall -q -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true

printf '%s\n' "$want" >"$STAMP"
log "virtualenv ready: $VENV"

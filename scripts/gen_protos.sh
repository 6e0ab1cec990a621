#!/usr/bin/env bash
# Regenerates the Python code of protos/*.proto: `bash scripts/gen_protos.sh`.
#
# The generator is pinned (grpcio-tools 1.84.0, in its own throwaway venv) so that the generated code
# runs on grpcio >= 1.84 and protobuf 7.x: the GPU image has grpcio 1.84.0 / protobuf 7.36.2, and
# grpc's generated code refuses a runtime older than the generator. Protos are compiled as
# splitspec/protos/<name>.proto, so the generated modules import each other as splitspec.protos.*.
# tests/test_protos.py regenerates into a scratch folder and checks the committed code is identical.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
OUT_DIR="${1:-$REPO/protos}"
GRPC_TOOLS="grpcio-tools==1.84.0"
VENV="${SPLITSPEC_PROTOC_VENV:-${TMPDIR:-/tmp}/splitspec-protoc-1.84.0}"
PY="${PYTHON:-python3}"

if ! "$VENV/bin/python" -c "import grpc_tools" >/dev/null 2>&1; then
    echo "gen_protos.sh: installing $GRPC_TOOLS into $VENV" >&2
    "$PY" -m venv "$VENV" >&2
    "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$GRPC_TOOLS" >&2
fi
ROOT="$(mktemp -d)"
trap 'rm -rf "$ROOT"' EXIT
mkdir -p "$ROOT/splitspec/protos" "$ROOT/out"
cp "$REPO"/protos/*.proto "$ROOT/splitspec/protos/"
(cd "$ROOT" && "$VENV/bin/python" -m grpc_tools.protoc -I . --python_out=out --pyi_out=out --grpc_python_out=out \
    splitspec/protos/*.proto)
mkdir -p "$OUT_DIR"
cp "$ROOT"/out/splitspec/protos/*.py "$ROOT"/out/splitspec/protos/*.pyi "$OUT_DIR/"
echo "gen_protos.sh: generated $(ls "$ROOT"/out/splitspec/protos | tr '\n' ' ')into $OUT_DIR" >&2

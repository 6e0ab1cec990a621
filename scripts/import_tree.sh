#!/usr/bin/env bash
# Prints a folder that imports as the installed `splitspec` (its sub-packages mapped from the top-level
# protos/, gateway/, verifier_svc/, drafter_svc/, kernels/ as pyproject's package-dir does), built
# from symlinks. For machines where the project is not pip-installed (the GPU image): put the printed
# folder on PYTHONPATH. The repo root itself must never be on the path.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
TREE="${1:-/tmp/splitspec-import-tree}"
rm -rf "$TREE"
mkdir -p "$TREE/splitspec"
for entry in "$REPO"/splitspec/*; do ln -s "$entry" "$TREE/splitspec/$(basename "$entry")"; done
for folder in protos gateway verifier_svc drafter_svc kernels; do ln -s "$REPO/$folder" "$TREE/splitspec/$folder"; done
echo "$TREE"

#!/usr/bin/env bash
# An import tree (as scripts/import_tree.sh makes) of this checkout with some files replaced by another commit's:
#   bash scripts/ab_tree.sh OVERLAY TREE     # OVERLAY holds repo-relative paths (e.g. `git show C:path > OVERLAY/path`)
# For an A/B on a machine that has only this working tree (the GPU image): files new since C are left in place
# (nothing old imports them). Prints TREE.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
OVERLAY="$(cd "$1" && pwd -P)"
TREE="$2"
COPY="$TREE.src"
rm -rf "$COPY" && mkdir -p "$COPY"
for folder in splitspec protos gateway verifier_svc drafter_svc kernels scripts; do cp -r "$REPO/$folder" "$COPY/"; done
rm -rf "$COPY/splitspec/demo_models" && ln -s "$REPO/splitspec/demo_models" "$COPY/splitspec/demo_models"
(cd "$OVERLAY" && find . -type f) | while read -r f; do cp "$OVERLAY/$f" "$COPY/$f"; done
bash "$COPY/scripts/import_tree.sh" "$TREE"

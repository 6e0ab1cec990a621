#!/usr/bin/env bash
# The device tool copies the working tree (tracked files and untracked ones git does not ignore) plus the carried
# paths, 64 MiB in all; this repo's tree with the wheels is over it. Before a GPU call:
#   bash scripts/gpu_slim.sh aside [--no-draft]   # then call the device with carry [".fi", ".whl", ".ficache", ".gpu-packed"]
#   bash scripts/gpu_slim.sh back                 # afterwards
# aside moves what GPU calls do not read into .gpu-aside/ (git-ignored): benchmarks/results, docs, deploy and the
# xgrammar wheel (the structured-output tests only), and packs the demo models' weights with xz into .gpu-packed/
# (git-ignored, carried; 47 -> 33 MB: bf16 weights keep a third of their bytes redundant), which scripts/gpu_env.sh
# unpacks in place on the device before anything reads them. --no-draft leaves the demo STANDALONE draft's weights out
# altogether (for calls that serve only the 8B shapes: a demo case would retrain the demo models).
# The tracked files moved are marked skip-worktree, so that `git commit -a` cannot commit their absence (it did once:
# 2d8dcb1 restored them); `back` restores them and clears the mark. `status` prints what the device tool would copy.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
aside=.gpu-aside
tracked=(benchmarks/results docs deploy)
draft=splitspec/demo_models/draft/model.safetensors
packed=.gpu-packed

size() {  # bytes the device tool copies: tracked and untracked-not-ignored files present, and the carried paths
    { git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c '[ -f "{}" ] && stat -c %s "{}"' ; \
      find .fi .whl .ficache "$packed" -type f -exec stat -c %s {} + 2>/dev/null; } | awk '{s += $1} END {print s + 0}'
}

case "${1:-status}" in
    aside)
        if [[ -d "$aside" ]]; then echo "already set aside: bash scripts/gpu_slim.sh back first" >&2; exit 1; fi
        # the demo weights go aside too: a test or service running from this checkout meanwhile finds them missing
        # and retrains them in place (it did once, overwriting them after `back`); run suites from a clone instead
        root=$(pwd -P)
        for cwd in /proc/[0-9]*/cwd; do
            dir=$(readlink "$cwd" 2>/dev/null) || continue
            [[ "$dir" == "$root" || "$dir" == "$root"/* ]] || continue
            pid=${cwd#/proc/} && pid=${pid%/cwd}
            if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -e pytest -e "-m splitspec"; then
                echo "process $pid runs from this checkout ($(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-80)):" \
                     "setting its files aside would break it; wait for it or run it from a clone" >&2
                exit 1
            fi
        done
        mkdir -p "$aside/whl"
        paths=("${tracked[@]}")
        [[ "${2:-}" == --no-draft ]] && paths+=("$draft")
        for p in "${paths[@]}"; do
            [[ -e "$p" ]] || continue
            git ls-files -z -- "$p" | xargs -0 -r git update-index --skip-worktree --
            mkdir -p "$aside/$(dirname "$p")" && mv "$p" "$aside/$p"
        done
        for w in .whl/xgrammar-*.whl; do [[ -e "$w" ]] && mv "$w" "$aside/whl/"; done
        rm -rf "$packed"
        while IFS= read -r -d '' w; do  # the demo weights, packed (a packed copy is remade when its source is newer)
            [[ -e "$w" ]] || continue
            mkdir -p "$aside/$(dirname "$w")" "$packed/$(dirname "$w")"
            cache="$aside.cache/$w.xz"
            if [[ ! -f "$cache" || "$w" -nt "$cache" ]]; then mkdir -p "$(dirname "$cache")" && xz -T0 -6 -c "$w" > "$cache"; fi
            cp "$cache" "$packed/$w.xz"
            git update-index --skip-worktree -- "$w" && mv "$w" "$aside/$w"
        done < <(git ls-files -z -- 'splitspec/demo_models/*.safetensors')
        echo "set aside; the device tool copies $(size) bytes (limit $((64 << 20)))" ;;
    back)
        for p in "${tracked[@]}" "$draft"; do
            if [[ -e "$aside/$p" ]]; then
                rm -rf "$p" && mkdir -p "$(dirname "$p")" && mv "$aside/$p" "$p"
            fi
            git ls-files -z -- "$p" | xargs -0 -r git update-index --no-skip-worktree --
        done
        while IFS= read -r -d '' w; do
            if [[ -e "$aside/$w" ]]; then rm -f "$w" && mv "$aside/$w" "$w"; fi
            git update-index --no-skip-worktree -- "$w"
        done < <(git ls-files -z -- 'splitspec/demo_models/*.safetensors')
        rm -rf "$packed"
        for w in "$aside"/whl/*.whl; do [[ -e "$w" ]] && mv "$w" .whl/; done
        rm -rf "$aside"
        git status --short | head -5
        echo "back; the device tool would copy $(size) bytes (limit $((64 << 20)))" ;;
    status) echo "the device tool would copy $(size) bytes (limit $((64 << 20)))" ;;
    *) echo "usage: bash scripts/gpu_slim.sh aside [--no-draft] | back | status" >&2; exit 2 ;;
esac

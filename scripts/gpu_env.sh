#!/usr/bin/env bash
#   . scripts/gpu_env.sh
# Source on the GPU machine from the repo root: installs the carried wheels (.whl/ for the services, .fi/
# for FlashInfer) into /tmp/site and puts them and the mapped splitspec package on PYTHONPATH; FlashInfer's
# JIT cache goes to /tmp/flashinfer (or $FLASHINFER_WORKSPACE_BASE).
# weights scripts/gpu_slim.sh packed to fit the device tool's copy: unpacked in place first
while IFS= read -r packed; do
    dest=${packed#.gpu-packed/} && dest=${dest%.xz}
    [[ -e "$dest" ]] || { mkdir -p "$(dirname "$dest")" && xz -dc "$packed" > "$dest.part" && mv "$dest.part" "$dest"; } || return 1
done < <(find .gpu-packed -name '*.xz' 2>/dev/null)
wheels=$(compgen -G ".whl/*.whl"; compgen -G ".fi/*.whl")
if [[ -n "$wheels" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || return 1
else  # git ignores them: the device tool copies them only when its call names them (a call without them ran, slowly, into import errors)
    echo "gpu_env.sh: no wheels in .whl/ or .fi/: call the device tool with carry [\".fi\", \".whl\", \".ficache\"]" >&2
    return 1
fi
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer}"
# FlashInfer modules compiled on an earlier machine (.ficache/*.txz: its JIT cache's .so files, same version and arch,
# made by `bash scripts/gpu_bench.sh jitcache`) are installed as its AOT modules, which it loads without compiling;
# only archives named for the FlashInfer version carried in .fi/ (flashinfer-<version>-*.txz)
fi_version=$(compgen -G ".fi/flashinfer_python-*.whl" | head -1 | sed 's/.*flashinfer_python-\([^-]*\)-.*/\1/')
if [[ -n "$fi_version" ]] && compgen -G ".ficache/flashinfer-$fi_version-*.txz" > /dev/null && [[ -d /tmp/site/flashinfer ]]; then
    rm -rf /tmp/ficache && mkdir -p /tmp/ficache
    for t in .ficache/flashinfer-"$fi_version"-*.txz; do tar xJf "$t" -C /tmp/ficache; done
    while IFS= read -r so; do
        name=$(basename "$(dirname "$so")") && mkdir -p "/tmp/site/flashinfer/data/aot/$name" && cp "$so" "/tmp/site/flashinfer/data/aot/$name/"
    done < <(find /tmp/ficache -path '*/cached_ops/*/*.so')
fi
export PYTHONPATH="$(bash scripts/import_tree.sh):/tmp/site" PYTHONUNBUFFERED=1
export PATH="/tmp/site/bin:$PATH"  # the carried wheels' commands (py-spy for benchmarks/spy_engine.sh)
if [[ -f .whl/prometheus.gz ]]; then
    mkdir -p /tmp/bin && gunzip -c .whl/prometheus.gz > /tmp/bin/prometheus && chmod +x /tmp/bin/prometheus
    export PATH="/tmp/bin:$PATH" SPLITSPEC_REQUIRE_PROMETHEUS=1
fi

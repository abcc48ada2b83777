#!/usr/bin/env bash
# The GPU check for a lent machine that has no Rust toolchain: binaries are
# built here first (benches/gpu/build.sh puts them in .gpubin/), the Vulkan
# loader travels as .deb files in .gl/, and this script runs them there.
# Same content as run.sh, timings first (each benchmark row also checks
# its output against the first path's), so a run cut short has measured
# what matters most: devices and their measured ceilings, GEMM/conv/
# attention and an SD1.5 UNet step beside PyTorch, conformance on the
# real adapter, then the step under VRAM budgets (bytes moved and time vs
# the planner's bound).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
report="$out/gpu-report.txt"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
if ! ldconfig -p | grep -q libvulkan.so.1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -f "$icd" ] && ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
    export VK_DRIVER_FILES="$icd"
fi
export SDKIT_ADAPTER="${SDKIT_ADAPTER:-nvidia}"
# build.sh leaves the binaries xz-compressed (the carried tree's size
# limit); Python's lzma unpacks them without needing xz there.
b=/tmp/gpubin
mkdir -p "$b"
python3 - <<'PY'
import glob, lzma, os, shutil
for f in glob.glob(".gpubin/*.xz"):
    dst = os.path.join("/tmp/gpubin", os.path.basename(f)[:-3])
    with lzma.open(f) as src, open(dst, "wb") as out:
        shutil.copyfileobj(src, out)
    os.chmod(dst, 0o755)
PY
{
    echo "== machine"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
    echo "== devices and the adapter's ceilings (what wgpu reaches on this GPU: the kernels' roof)"
    timeout 60 $b/sdkit devices --probe "$SDKIT_ADAPTER"
    echo "== wgpu_ops (GEMM, conv, attention, UNet-shaped) vs torch"
    # SDKIT_BENCH_TILINGS=1 adds every fixed GEMM tiling (retuning the
    # tiling table on a new adapter; the H200's is in RESULTS.md).
    timeout 150 $b/wgpu_ops --bench 2>&1
    echo "== SD1.5 UNet step vs torch fp16 (the tuned row measures every kernel's variants first)"
    timeout 270 $b/unet_step --bench 2>&1
    echo "== 10-step Euler loop with CFG: host loop vs device loop (latent kept on the GPU)"
    SDKIT_BENCH_LOOP=1 timeout 90 $b/unet_step --bench 2>&1
    echo "== conformance + backend tests on the real adapter"
    timeout 150 $b/conformance -q 2>&1 | grep -E "conformance:|test result|FAILED|panicked|nmse|failures" | head -n 40
    timeout 60 $b/wgpu_backend -q 2>&1 | tail -n 25
    timeout 30 $b/shaders -q 2>&1 | tail -n 3
    echo "== SD1.5 UNet step under 100/50/25% VRAM budgets (residency)"
    SDKIT_BENCH_BUDGETS=1 timeout 90 $b/unet_step --bench 2>&1
} 2>&1 | tee "$report"

#!/usr/bin/env bash
# One prepared GPU check, for a machine with a real GPU (and PyTorch with
# CUDA for the peer numbers). Builds, runs the wgpu conformance suite and
# backend tests on the real adapter, then benchmarks against PyTorch.
# Meant to finish in well under 8 minutes.
#   bash benches/gpu/run.sh            # everything
#   SDKIT_ADAPTER=nvidia bash benches/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
out="${OUT:-/tmp}/sdkit-gpu-report.txt"
{
    echo "== devices"
    cargo run --release -q -- devices --probe "${SDKIT_ADAPTER:-}"
    echo "== conformance (cpu + wgpu on the real adapter)"
    cargo test --release -q -p sdkit-compute --test conformance --test wgpu_backend 2>&1 | tail -n 30
    echo "== benchmarks"
    SDKIT_BENCH_PYTHON="${SDKIT_BENCH_PYTHON:-python3}" cargo bench -q --bench wgpu_ops 2>&1
    SDKIT_BENCH_PYTHON="${SDKIT_BENCH_PYTHON:-python3}" cargo bench -q --bench unet_step 2>&1
    SDKIT_BENCH_LOOP=1 cargo bench -q --bench unet_step 2>&1
    SDKIT_BENCH_BUDGETS=1 cargo bench -q --bench unet_step 2>&1
    SDKIT_BENCH_PYTHON="${SDKIT_BENCH_PYTHON:-python3}" cargo bench -q --bench cpu_ops 2>&1
} 2>&1 | tee "$out"
echo "report: $out"

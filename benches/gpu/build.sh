#!/usr/bin/env bash
# Builds the release binaries that benches/gpu/device.sh runs on a lent GPU
# machine without a Rust toolchain, into .gpubin/ (ignored; carry it).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpubin
cargo build --release -q --bin sdkit
cp target/release/sdkit .gpubin/
# Test and bench executables: cargo prints their paths as JSON messages.
for spec in "test --release -p sdkit-engine --test conformance --test wgpu_backend --test shaders" \
    "bench --bench wgpu_ops --bench unet_step"; do
    # shellcheck disable=SC2086
    cargo $spec --no-run --message-format=json -q |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["bin"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name path; do cp "$path" ".gpubin/$name"; done
done
strip .gpubin/* 2>/dev/null || true
ls -la .gpubin

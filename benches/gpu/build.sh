#!/usr/bin/env bash
# Builds the release binaries that benches/gpu/device.sh runs on a lent GPU
# machine without a Rust toolchain, into .gpubin/, and fetches the Vulkan
# loader it lacks as .deb files into .gl/. Both are excluded from git
# here (.git/info/exclude): name them in the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.gpubin/ /.gl/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude
done
if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
    mkdir -p .gl /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update -qq
    # shellcheck disable=SC2086
    (cd .gl && apt-get $o download -qq libvulkan1)
fi
mkdir -p .gpubin
cargo build --release -q --bin sdkit
cp target/release/sdkit .gpubin/
# Test and bench executables: cargo prints their paths as JSON messages.
for spec in "test --release -p sdkit-compute --test conformance --test wgpu_backend --test shaders" \
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
# Compressed: the working tree a device call carries is limited to 64
# MiB, the repository itself is ~25 MiB and the binaries ~58 MiB stripped
# (~16 compressed); device.sh unpacks them there.
for f in .gpubin/*; do
    case "$f" in *.xz) continue ;; esac
    xz -T2 -6 -f "$f"
done
ls -la .gpubin
du -sh .gpubin

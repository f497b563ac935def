# One entry point: `make test` sets everything up from a clean clone and runs every test;
# `make simulate` sets up and runs `kvstride simulate` on the embedded store.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch: the CPU build in ../shared/wheels when present (PyPI has only CUDA builds).
export PIP_FIND_LINKS ?= $(abspath ../shared/wheels)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

PY_DEPS := "numpy>=1.22" "torch==2.13.*" "xxhash>=3" "tqdm>=4" "matplotlib>=3.5" \
           "mooncake-transfer-engine-non-cuda==0.3.13.post1"
TEST_DEPS := "pytest>=7" "hypothesis>=6" "cbor2>=5.4"

.PHONY: setup system-deps build test test-rust test-python simulate bench clean

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
	$(PY) -m pip install -q $(PY_DEPS) $(TEST_DEPS)

build: setup
	$(VENV)/bin/maturin develop -q --release

test-rust:
	cargo test --release -q

test-python: build
	$(PY) -m pytest -q

test: test-rust test-python

simulate: build
	$(VENV)/bin/kvstride simulate --preset glm-ring

bench: build
	$(VENV)/bin/kvstride bench --rust

clean:
	rm -rf $(VENV) target

# One entry point: `make test` sets everything up from a clean clone and runs every test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
export PIP_FIND_LINKS ?= $(abspath ../shared/wheels)
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup build test test-rust test-python bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip "maturin>=1.5,<2"

setup: $(PY)
	$(PY) -m pip install -q "numpy>=1.22" "pytest>=7" "hypothesis>=6" "cbor2>=5.4" "xxhash>=3"

build: setup
	$(VENV)/bin/maturin develop -q --release

test-rust:
	cargo test --release -q

test-python: build
	$(PY) -m pytest -q

test: test-rust test-python

bench: build
	cargo bench --bench core
	$(PY) benches/keypath.py

clean:
	rm -rf $(VENV) target

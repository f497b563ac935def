"""Fixtures shared by the in-process vLLM tiers (``test_vllm.py``, ``test_vllm_secret.py``):
the tiny models, written once per session, and each model's scenario without a connector (the
reference every connector run is compared with), computed once per session."""

from __future__ import annotations

import pytest

import vllm_harness as harness


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: m.build(root / name) for name, m in harness.MODELS.items()}


@pytest.fixture(scope="session")
def plain_outputs(model_dirs):
    """Each model's scenario without a connector (computed once, on first use)."""
    from vllm import LLM

    cache = {}

    def get(name):
        if name not in cache:
            llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name]))
            try:
                cache[name] = harness.scenario(llm)
            finally:
                harness.close(llm)
        return cache[name]

    return get

"""The device path as the vLLM worker drives it, on modelled CUDA streams (``test_arena_device``):
the groups it fences come from a real vLLM ``KVCacheConfig`` through the worker's own function.

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402

from kvstride.vllm.config import group_specs  # noqa: E402
from kvstride.vllm.worker import fenced_groups  # noqa: E402
from test_arena_device import _fenced_engine  # noqa: E402
from test_vllm_identity import vllm_config  # noqa: E402


def _mamba_hybrid_fenced_groups(tmp_path) -> frozenset:
    """What the worker fences on a full-attention + Mamba hybrid in vLLM's "align" mode."""
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                         FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)),
        KVCacheGroupSpec(["model.layers.1.linear_attn"],
                         MambaSpec(block_size=64, shapes=((4, 96),), dtypes=(torch.bfloat16,), mamba_cache_mode="align")),
    ])
    config = vllm_config(tmp_path, {"store": "embedded"}, cache={"mamba_cache_mode": "align"})
    return fenced_groups(group_specs(kv_cache_config, config), kv_cache_config)


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_a_mamba_hybrids_step_waits_for_its_saves_gathers_not_for_an_earlier_saves_drain(monkeypatch, tmp_path, path):
    """On a Mamba hybrid vLLM writes new blocks before the connector's fence, so the worker
    fences no group and the step's stream waits at once for its saves' reads. Those are device
    gathers into staging: the step's next kernel follows this step's gathers, and neither they
    nor it follow the previous step's drain to host memory (a host-link copy), as one stream
    for gathers and drains made them. Into the arena's slots and through the staging pool
    (Mooncake) alike."""
    fenced = _mamba_hybrid_fenced_groups(tmp_path)
    assert fenced == frozenset()
    engine, streams, launches, entries = _fenced_engine(monkeypatch, path)
    engine.submit_planned(puts={1: entries[:3]}, fenced_groups=fenced)  # one chunk each
    engine.submit_planned(puts={2: entries[3:6]}, fenced_groups=fenced)
    forward = streams.launch("the step's forward")
    assert engine.wait_idle(30) and engine.get_finished().jobs_done == {1: "ok", 2: "ok"}
    gathers, drains = launches["gather"], launches["drain"]
    first = len(gathers) // 2  # each save's chunks
    before = streams.before
    assert all(before(gather, forward) for gather in gathers)
    assert not any(before(drain, gather) for drain in drains[:first] for gather in gathers[first:])
    assert not any(before(drain, forward) for drain in drains)
    engine.shutdown()

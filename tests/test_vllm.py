"""End to end through a real vLLM engine (CPU, in-process): engine 1 saves a prompt's KV
through ``kvstride.vllm.KVStrideConnector`` into a shared embedded store; engine 2 (fresh,
same store) runs the same prompt plus a few tokens, must load a prefix hit from the store
and produce the same greedy tokens as an engine without the connector.

The models are tiny with random (not dummy) weights, so wrong KV changes the output.
Skipped where vLLM is not installed (it needs its own environment, see the Makefile).
"""

from __future__ import annotations

import gc
import json
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

import kvstride.vllm as kv_vllm  # noqa: E402

BLOCK = 32
MAX_TOKENS = 12


def _write_model(path, config) -> str:
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, config.architectures[0])
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _llama(path) -> str:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return _write_model(path, cfg)


def _gemma3(path) -> str:
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
        sliding_window=64, sliding_window_pattern=4, query_pre_attn_scalar=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    return _write_model(path, cfg)


def _qwen3_next(path) -> str:
    """3 Gated-DeltaNet (Mamba-style, linear head dim 64) layers + 1 full-attention layer."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64, decoder_sparse_step=1,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3NextForCausalLM"]
    return _write_model(path, cfg)


MODELS = {"llama": _llama, "gemma3": _gemma3}


def _engine(model: str, connector_store=None, **kw) -> LLM:
    if connector_store is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStrideConnector",
            kv_connector_module_path="kvstride.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"store": "embedded", "store_name": connector_store},
        )
    return LLM(
        model=model, load_format="safetensors", skip_tokenizer_init=True, enforce_eager=True,
        max_model_len=1024, block_size=BLOCK, seed=0,
        distributed_executor_backend="uni", **{"kv_cache_memory_bytes": 32 << 20, **kw},
    )


def _connectors(llm: LLM):
    """(scheduler-side, worker-side) connector of an in-process engine."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector, get_kv_transfer_group()


def _run(llm: LLM, prompt):
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _close(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefix_hit_from_store_matches_plain_run(tmp_path, arch, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = MODELS[arch](tmp_path / arch)
    prompt = [(7 * i + 3) % 500 + 3 for i in range(150)]  # 4 full blocks + 22 tokens
    longer = prompt + [11, 22, 33, 44, 55]

    plain = _engine(model)
    expected_first, expected = _run(plain, prompt), _run(plain, longer)
    _close(plain)

    store_name = f"test-{arch}-{os.getpid()}"
    try:
        producer = _engine(model, store_name)
        assert _run(producer, prompt) == expected_first
        sched, worker = _connectors(producer)
        assert sched.matched_tokens == 0  # a fresh store: nothing to load
        assert worker.engine.counters["put_ok"] > 0, worker.engine.counters
        _close(producer)

        consumer = _engine(model, store_name)
        got = _run(consumer, longer)
        sched, worker = _connectors(consumer)
        counters = dict(worker.engine.counters)
        assert sched.matched_tokens >= 4 * BLOCK - BLOCK, counters  # a prefix hit from the store
        assert counters.get("get_ok", 0) > 0 and not counters.get("loads_failed"), counters
        assert got == expected
        _close(consumer)
    finally:
        kv_vllm.drop_shared_stores()


@pytest.mark.parametrize("failure", ["status", "raise"])
def test_failed_load_is_recomputed(tmp_path, failure, monkeypatch):
    """A store whose gets fail (a status, or an exception inside the job) never raises into
    vLLM's step: the claimed blocks come back as load errors, vLLM recomputes them and the
    output is still the plain run's."""
    from kvstride.stores import EmbeddedStore, Status

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = _llama(tmp_path / "llama")
    prompt = [(5 * i + 1) % 500 + 3 for i in range(100)]
    longer = prompt + [9, 8, 7]

    plain = _engine(model)
    expected = _run(plain, longer)
    _close(plain)

    store_name = f"test-fail-{failure}-{os.getpid()}"
    try:
        producer = _engine(model, store_name)
        _run(producer, prompt)
        _close(producer)

        if failure == "status":
            monkeypatch.setattr(EmbeddedStore, "get", lambda self, keys, bufs: [Status.UNAVAILABLE] * len(keys))
        else:
            def boom(self, keys, bufs):
                raise RuntimeError("store exploded")

            monkeypatch.setattr(EmbeddedStore, "get", boom)
        reported = []
        orig = kv_vllm.KVStrideConnector.get_block_ids_with_load_errors

        def spy(self):
            out = orig(self)
            reported.extend(out)
            return out

        monkeypatch.setattr(kv_vllm.KVStrideConnector, "get_block_ids_with_load_errors", spy)
        consumer = _engine(model, store_name)
        got = _run(consumer, longer)
        sched, _ = _connectors(consumer)
        assert sched.matched_tokens > 0
        assert reported, "the failed blocks were not reported to vLLM"
        assert got == expected
        _close(consumer)
    finally:
        kv_vllm.drop_shared_stores()


def test_mamba_boundary_state_from_store(tmp_path, monkeypatch):
    """A hybrid Gated-DeltaNet model with prefix caching in Mamba ``align`` mode: the GDN
    groups' state is stored only from vLLM's boundary-state hand-offs
    (``kv_connector_block_state.boundary_state_offloads``), so engine 2's prefix hit (which
    every group must serve) includes the linear-attention state loaded from the store."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = _qwen3_next(tmp_path / "qwen3_next")
    kw = dict(enable_prefix_caching=True, mamba_cache_mode="align", kv_cache_memory_bytes=64 << 20)
    prompt = [(7 * i + 3) % 500 + 3 for i in range(400)]  # vLLM forces block 160: 2 blocks + 80
    longer = prompt + [11, 22, 33, 44, 55]

    plain = _engine(model, **kw)
    expected_first, expected = _run(plain, prompt), _run(plain, longer)
    _close(plain)

    store_name = f"test-mamba-{os.getpid()}"
    try:
        producer = _engine(model, store_name, **kw)
        assert _run(producer, prompt) == expected_first
        sched, worker = _connectors(producer)
        kinds = [g.kind for g in sched.groups]
        assert kinds.count("mamba") == 3 and "full_attention" in kinds, kinds
        block = sched.groups[0].block_size
        counters = dict(worker.engine.counters)
        assert counters.get("tail_planned", 0) > 0, counters  # hand-offs reached the planner
        _close(producer)

        consumer = _engine(model, store_name, **kw)
        got = _run(consumer, longer)
        sched, worker = _connectors(consumer)
        counters = dict(worker.engine.counters)
        # The hit (every group, the GDN state included) covers the prompt's full blocks.
        assert sched.matched_tokens == (len(prompt) // block) * block, (sched.matched_tokens, counters)
        n_blocks = len(prompt) // block
        assert counters.get("get_ok", 0) == n_blocks + 3 and not counters.get("loads_failed"), counters
        assert got == expected
        _close(consumer)
    finally:
        kv_vllm.drop_shared_stores()

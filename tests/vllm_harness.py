"""A real vLLM engine run so that wrong KV shows: tiny random-weight models whose output depends
on every KV-cache group, settings under which vLLM itself is hit-invariant, and a forced miss
(drain, ``reset_prefix_cache()``, every KV tensor overwritten with random values) between
requests, so that a load which writes nothing or the wrong block changes tokens or logprobs.

Used by ``tests/test_vllm.py`` (in-process and multi-process engines) and
``benches/vllm_connectors.py``.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

#: Prompt lengths of every scenario: P1 has 480 tokens, P2 shares its first 384.
PROMPT_TOKENS = 480
SHARED_TOKENS = 384
MAX_TOKENS = 8


def _write_model(path: Path, config, *, tweak=None, extra_config=None) -> str:
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        if tweak is not None:
            tweak(model)
    model.to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
    vocab_size=512, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
)


def llama(path: Path) -> str:
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, rms_norm_eps=1e-6, tie_word_embeddings=False, **_COMMON)
    cfg.architectures = ["LlamaForCausalLM"]
    return _write_model(path, cfg)


def gemma3(path: Path) -> str:
    """3 sliding-window layers (window 64) + 1 full-attention layer: 4 KV-cache groups."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        num_hidden_layers=4, sliding_window=64, sliding_window_pattern=4, query_pre_attn_scalar=32,
        pad_token_id=0, **_COMMON,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    return _write_model(path, cfg)


def qwen3_next(path: Path) -> str:
    """3 Gated-DeltaNet layers + 1 full-attention layer (vLLM forces block 160). ``A_log`` =
    -4.6 makes the GDN decay slow, so the state matters 100+ tokens later."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(
        num_hidden_layers=4, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        decoder_sparse_step=1, tie_word_embeddings=False, **_COMMON,
    )
    cfg.architectures = ["Qwen3NextForCausalLM"]

    def slow_decay(model):
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(-4.6)

    return _write_model(path, cfg, tweak=slow_decay)


def lfm2(path: Path) -> str:
    """3 short-conv layers + 1 full-attention layer (block 32)."""
    from transformers import Lfm2Config

    common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    cfg = Lfm2Config(num_hidden_layers=4, full_attn_idxs=[3], tie_word_embeddings=False, **common)
    cfg.architectures = ["Lfm2ForCausalLM"]
    # vLLM 0.32 reads these names of the transformers-4 config.
    return _write_model(path, cfg, extra_config={"conv_dim": 64, "block_dim": 64})


def gpt_oss(path: Path) -> str:
    """A sliding-window layer (window 64) + a full-attention layer, 4 experts (MoE, sinks)."""
    from transformers import GptOssConfig

    cfg = GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False, **_COMMON,
    )
    cfg.architectures = ["GptOssForCausalLM"]
    return _write_model(path, cfg)


@dataclass(frozen=True)
class Model:
    name: str
    build: object
    block_size: int  # the block size vLLM runs the model with
    engine_kwargs: tuple = ()

    def kwargs(self) -> dict:
        return dict(self.engine_kwargs)


# Prefix caching puts Mamba groups in "align" mode (vLLM 0.33 deprecates passing it).
_MAMBA = (("kv_cache_memory_bytes", 96 << 20),)

MODELS: Dict[str, Model] = {
    "llama": Model("llama", llama, 32),
    "gemma3": Model("gemma3", gemma3, 32),
    "qwen3_next": Model("qwen3_next", qwen3_next, 160, _MAMBA),
    "lfm2": Model("lfm2", lfm2, 32, _MAMBA),
    "gpt_oss": Model("gpt_oss", gpt_oss, 32),
}

#: The external hit vLLM's MooncakeStoreConnector reaches under these settings for P2 (sharing
#: 384 of 480 tokens), measured by benches/vllm_connectors.py: 384 on every model.
PEER_HITS = {"llama": 384, "gemma3": 384, "qwen3_next": 384, "lfm2": 384, "gpt_oss": 384}


def prompts() -> Tuple[List[int], List[int]]:
    p1 = [(7 * i + 3) % 500 + 3 for i in range(PROMPT_TOKENS)]
    p2 = p1[:SHARED_TOKENS] + [(11 * i + 5) % 500 + 3 for i in range(PROMPT_TOKENS - SHARED_TOKENS)]
    return p1, p2


def connector_config(store: dict, *, module: str = "kvstride.vllm"):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KVStrideConnector", kv_connector_module_path=module, kv_role="kv_both",
        kv_load_failure_policy="recompute", kv_connector_extra_config=dict(store),
    )


def engine_kwargs(model: Model, path: str, *, connector: Optional[dict] = None, backend: str = "uni") -> dict:
    """``LLM(**kwargs)`` for ``model``: one block per prefill chunk and dense retention, under
    which vLLM's own output does not depend on where a prefix hit ends."""
    kw = dict(
        model=path, load_format="safetensors", skip_tokenizer_init=True, enforce_eager=True,
        max_model_len=1024, block_size=32, seed=0, enable_prefix_caching=True,
        max_num_batched_tokens=model.block_size, prefix_cache_retention_interval=None,
        distributed_executor_backend=backend, kv_cache_memory_bytes=32 << 20, max_num_seqs=4,
        # Block hashes that agree across engines and processes (a shared store needs them).
        prefix_caching_hash_algo="sha256_cbor",
    )
    kw.update(model.kwargs())
    if connector is not None:
        kw["kv_transfer_config"] = connector_config(connector)
    return kw


def randomize_kv(worker, seed: int) -> int:
    """Overwrite every KV-cache tensor of ``worker`` (all blocks but the null block 0) with
    finite random values; returns the bytes written. Runs inside the worker
    (``LLM.collective_rpc``). Raw state views (int8) get the bytes of random bf16 values, so
    fp32 or bf16 state read from them stays finite."""
    gen = torch.Generator().manual_seed(seed)
    written = 0
    seen = set()
    for kv in worker.model_runner.kv_caches:
        tensors = kv if isinstance(kv, (list, tuple)) else [kv]
        for t in tensors:
            key = (t.data_ptr(), t.shape, t.stride())
            if key in seen:
                continue
            seen.add(key)
            body = t[1:]
            if body.dtype.is_floating_point:
                body.copy_(torch.randn(body.shape, generator=gen).to(body.dtype))
            else:
                noise = torch.randn(body.numel() * body.element_size() // 2, generator=gen)
                body.copy_(noise.to(torch.bfloat16).view(body.dtype).view(body.shape))
            written += body.numel() * body.element_size()
    return written


def drain_and_forget(llm, seed: int) -> None:
    """Wait until no request holds a block, reset vLLM's prefix cache (until it says it did)
    and overwrite every KV tensor: the next request can only hit through the connector."""
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError("reset_prefix_cache() never succeeded: some request still holds blocks")
        llm.llm_engine.step()  # lets the connector report the saves that hold blocks
        time.sleep(0.005)
    assert sum(llm.collective_rpc(randomize_kv, args=(seed,))) > 0


@dataclass
class Output:
    tokens: List[int]
    logprobs: List[float]


def generate(llm, prompt: Sequence[int]) -> Output:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], sp, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs, tokens)]
    return Output(tokens, logprobs)


def scenario(llm, after=None) -> Dict[str, Output]:
    """P1 (fills the store), then P2 (80 % shared) and the exact repeat of P1, each after a
    forced miss. ``after(phase)`` is called once each phase's request finished."""
    p1, p2 = prompts()
    out = {}
    for seed, (phase, prompt) in enumerate((("p1", p1), ("p2", p2), ("repeat", p1))):
        if seed:
            drain_and_forget(llm, seed)
        out[phase] = generate(llm, prompt)
        if after is not None:
            after(phase)
    return out


def mismatches(got: Dict[str, Output], want: Dict[str, Output], tol: float = 1e-6) -> List[str]:
    """What differs between two scenario outputs: tokens, or a logprob by more than ``tol``."""
    bad = []
    for name, w in want.items():
        g = got[name]
        if g.tokens != w.tokens:
            bad.append(f"{name}: tokens {g.tokens} != {w.tokens}")
            continue
        worst = max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs))
        if worst > tol:
            bad.append(f"{name}: logprobs differ by up to {worst:.3g}")
    return bad


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


# ---- servers (tests/test_vllm_serve.py) ------------------------------------------------------


class KVRandomizer:
    """A vLLM worker extension (``--worker-extension-cls vllm_harness.KVRandomizer``) that
    makes the forced miss's overwrite reachable from outside a server: ``POST /collective_rpc``
    with ``{"method": "randomize_kv_cache", "args": ["<seed>"]}`` (the dev endpoints, env
    ``VLLM_SERVER_DEV_MODE=1``, pass arguments as strings) runs :func:`randomize_kv` in every
    worker and answers ``{"results": ["<bytes written>", ...]}``."""

    def randomize_kv_cache(self, seed) -> int:
        return randomize_kv(self, int(seed))

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
import urllib.error
import urllib.request
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


def llama_finetuned(path: Path) -> str:
    """:func:`llama` fine-tuned: the same config, every weight moved (written over ``path``)."""
    from transformers import LlamaConfig

    def tune(model):
        generator = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)

    cfg = LlamaConfig(num_hidden_layers=2, rms_norm_eps=1e-6, tie_word_embeddings=False, **_COMMON)
    cfg.architectures = ["LlamaForCausalLM"]
    return _write_model(path, cfg, tweak=tune)


def secret_forms(secret: bytes) -> List[bytes]:
    """The ways a secret could be printed: raw, as Python prints bytes, hex (both cases), base64
    (both alphabets)."""
    import base64

    return [secret, repr(secret)[2:-1].encode(), secret.hex().encode(), secret.hex().upper().encode(), base64.b64encode(secret),
            base64.urlsafe_b64encode(secret), base64.b64encode(secret).rstrip(b"=")]


def gemma3(path: Path) -> str:
    """3 sliding-window layers (window 64) + 1 full-attention layer: 4 KV-cache groups."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        num_hidden_layers=4, sliding_window=64, sliding_window_pattern=4, query_pre_attn_scalar=32,
        pad_token_id=0, **_COMMON,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    return _write_model(path, cfg)


def deepseek_v2(path: Path) -> str:
    """Multi-head latent attention (MLA: one 576-wide latent KV cache a layer, the one size vLLM's
    CPU MLA backend takes) and a small MoE: 1 dense layer + 1 MoE layer of 4 experts. vLLM's CPU
    platform runs MLA with 16-token blocks and without prefix caching."""
    from transformers import DeepseekV2Config

    cfg = DeepseekV2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=64,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1,
        vocab_size=512, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, rope_scaling=None,
    )
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    return _write_model(path, cfg)


def _slow_decay(model) -> None:
    """``A_log`` = -4.6 in every Mamba/GDN layer: a slow decay, so the state matters 100+ tokens
    later."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.fill_(-4.6)


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
    return _write_model(path, cfg, tweak=_slow_decay)


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


def nemotron_h_swa(path: Path) -> str:
    """Mamba-2, sliding-window attention (window 64), Mamba-2, MLP: a window group next to two
    Mamba groups and no full attention (vLLM forces block 64). ``A_log`` = -4.6 makes the
    Mamba decay slow, so the state matters 100+ tokens later. Dense retention only: under
    ``prefix_cache_retention_interval=0`` vLLM 0.32 (CPU) itself decodes token 0 (NaN logits)
    after P1's 480 tokens (not a multiple of 64), on a fresh engine without a connector."""
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(
        layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"], sliding_window=64,
        mamba_num_heads=4, mamba_head_dim=32, n_groups=1, ssm_state_size=16, expand=2, conv_kernel=4,
        tie_word_embeddings=False, **_COMMON,
    )
    cfg.architectures = ["NemotronHForCausalLM"]
    # vLLM 0.32 reads the layer pattern under its transformers-4 name.
    return _write_model(path, cfg, tweak=_slow_decay, extra_config={"hybrid_override_pattern": "M*M-"})


#: LoRA settings of an engine that serves :func:`lora_adapter` s (``engine_kwargs`` overrides).
LORA_ENGINE = dict(enable_lora=True, max_lora_rank=8, max_loras=1)


def lora_adapter(folder: Path, base: str, version: int) -> str:
    """A PEFT LoRA adapter of :func:`llama` on q/k/v at rank 8, written over ``folder``:
    ``version`` decides its weights (a retrained adapter is another version, the same config)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj"], "peft_type": "LORA",
        "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
    }))
    generator = torch.Generator().manual_seed(1000 + version)
    tensors = {}
    for layer in range(2):
        for module in ("q_proj", "k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(8, _COMMON["hidden_size"], generator=generator) * 0.5
            tensors[prefix + ".lora_B.weight"] = torch.randn(64, 8, generator=generator) * 0.5
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


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
# vLLM's CPU platform stores GDN state in float32 where the CPU has AVX-512 BF16 and in the
# model's bf16 elsewhere; the state's page sets the block size (160 tokens against 96), so the
# harness fixes float32 for the same blocks, hand-offs and hits on every CPU.
_GDN = _MAMBA + (("mamba_ssm_cache_dtype", "float32"),)

MODELS: Dict[str, Model] = {
    "llama": Model("llama", llama, 32),
    "gemma3": Model("gemma3", gemma3, 32),
    "qwen3_next": Model("qwen3_next", qwen3_next, 160, _GDN),
    "lfm2": Model("lfm2", lfm2, 32, _MAMBA),
    "gpt_oss": Model("gpt_oss", gpt_oss, 32),
    "nemotron_h_swa": Model("nemotron_h_swa", nemotron_h_swa, 64, _MAMBA),
}

#: The external hit vLLM's MooncakeStoreConnector reaches under these settings for P2 (sharing
#: 384 of 480 tokens), measured by benches/vllm_connectors.py: 384, but 320 on Qwen3-Next, whose
#: 160-token blocks put the boundary below 384 at 320.
PEER_HITS = {"llama": 384, "gemma3": 384, "qwen3_next": 320, "lfm2": 384, "gpt_oss": 384, "nemotron_h_swa": 384}


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


def engine_kwargs(
    model: Model, path: str, *, connector: Optional[dict] = None, backend: str = "uni", **overrides
) -> dict:
    """``LLM(**kwargs)`` for ``model``: one block per prefill chunk and dense retention, under
    which vLLM's own output does not depend on where a prefix hit ends. ``overrides`` replace
    any of these settings (a test that changes one compares with a plain run that changes it
    too)."""
    kw = dict(
        model=path, load_format="safetensors", skip_tokenizer_init=True, enforce_eager=True,
        max_model_len=1024, block_size=32, seed=0, enable_prefix_caching=True,
        max_num_batched_tokens=model.block_size, prefix_cache_retention_interval=None,
        distributed_executor_backend=backend, kv_cache_memory_bytes=32 << 20, max_num_seqs=4,
        # Block hashes that agree across engines and processes (a shared store needs them).
        prefix_caching_hash_algo="sha256_cbor",
    )
    kw.update(model.kwargs())
    kw.update(overrides)
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


def saves_landed(worker, timeout: float = 120.0) -> bool:
    """(In a worker, ``LLM.collective_rpc``) Wait until every store put kvstride's connector
    queued has run: its copies leave the KV cache within the step, its Mooncake puts run later
    on the save lane. True at once for another connector or none."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return True
    engine = getattr(getattr(get_kv_transfer_group(), "side", None), "engine", None)
    return engine is None or engine.wait_idle(timeout)


def drain_and_forget(llm, seed: int) -> None:
    """Wait until no request holds a block and every save reached the store, reset vLLM's
    prefix cache (until it says it did) and overwrite every KV tensor: the next request can
    only hit through the connector, on everything stored before it."""
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError("reset_prefix_cache() never succeeded: some request still holds blocks")
        llm.llm_engine.step()  # lets the connector report the saves that hold blocks
        time.sleep(0.005)
    assert all(llm.collective_rpc(saves_landed)), "a worker's saves did not land within the timeout"
    assert sum(llm.collective_rpc(randomize_kv, args=(seed,))) > 0


@dataclass
class Output:
    tokens: List[int]
    logprobs: List[float]


def sampling(max_tokens: int = MAX_TOKENS):
    """Greedy, every sampled token's logprob, no tokenizer."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0)


def generate(llm, prompt: Sequence[int], max_tokens: int = MAX_TOKENS, lora_request=None) -> Output:
    from vllm.inputs import TokensPrompt

    sp = sampling(max_tokens)
    out = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], sp, use_tqdm=False,
                       lora_request=lora_request)[0].outputs[0]
    tokens = list(out.token_ids)
    logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs, tokens)]
    return Output(tokens, logprobs)


def scenario(llm, after=None) -> Dict[str, Output]:
    """P1 (fills the store), then P2 (80 % shared) and the exact repeat of P1, each after a
    forced miss. ``after(phase)`` is called once each phase's request finished. Ends with
    :func:`assert_idle`: every block vLLM lent the requests is back."""
    idle = free_blocks(llm)
    p1, p2 = prompts()
    out = {}
    for seed, (phase, prompt) in enumerate((("p1", p1), ("p2", p2), ("repeat", p1))):
        if seed:
            drain_and_forget(llm, seed)
        out[phase] = generate(llm, prompt)
        if after is not None:
            after(phase)
    assert_idle(llm, idle)
    return out


# ---- idle: every block back once no request runs -------------------------------------------


def scheduler_of(llm):
    """The scheduler of an engine whose EngineCore runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), else None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return getattr(core, "scheduler", None)


def free_blocks(llm) -> Optional[int]:
    """vLLM's free KV blocks (in-process engines; None where the scheduler is in another
    process). Right after the engine started this is its idle value."""
    sched = scheduler_of(llm)
    return None if sched is None else sched.kv_cache_manager.block_pool.get_num_free_blocks()


def assert_idle(llm, idle: Optional[int], timeout: float = 30.0, max_steps: int = 64) -> None:
    """With no request left to run, vLLM gets back every block it lent (a connector that holds
    a finished request's blocks must report it without any new request arriving): the engine,
    stepped while it has finished-but-held requests (steps without a forward), ends with
    ``reset_prefix_cache()`` succeeding and, where the scheduler is reachable, no request left
    and the free-block count at ``idle`` (its value at engine start). In-process engines get
    at most ``max_steps`` such steps; other layouts step themselves and get ``timeout`` s."""
    sched = scheduler_of(llm)
    deadline = time.monotonic() + timeout
    steps = 0
    while True:
        reset = llm.reset_prefix_cache()
        if sched is None:
            if reset:
                return
        else:
            free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
            left = sorted(sched.requests)
            if reset and not left and (idle is None or free == idle):
                return
        if time.monotonic() > deadline or steps >= max_steps:
            detail = "" if sched is None else f"; requests still held: {left}, free blocks {free} != idle {idle}"
            raise AssertionError(
                f"vLLM's blocks never came back after the workload ({steps} idle steps, "
                f"reset_prefix_cache() -> {reset}){detail}"
            )
        if sched is not None:
            llm.llm_engine.step()  # no new request: only held (finished) ones, no forward
            steps += 1
        time.sleep(0.005)


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


def wait_healthy(proc, url: str, timeout: float, log_line) -> None:
    """Poll a ``vllm serve`` at ``url`` until ``/health`` answers 200; raises RuntimeError with
    ``log_line()`` (what its log says) when the process exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}: {log_line()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"vllm serve not healthy after {timeout:.0f} s: {log_line()}")


def metric_sums_of(exposition: str) -> Dict[str, float]:
    """A ``/metrics`` page: each series' value summed over its labels."""
    sums: Dict[str, float] = {}
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0]
            sums[name] = sums.get(name, 0.0) + float(value)
    return sums


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


# ---- block bytes: what a stored value must equal ----------------------------------------------


def block_bytes(layout, group: int, block_id: int) -> bytes:
    """The bytes of one block of one KV-cache group as the connector stores them (the
    concatenation of its pieces, ``kvstride.layout.KVLayout``), read from the KV tensors now."""
    storages = layout.storages
    parts = []
    for p in layout.groups[group].pieces:
        start = p.offset + int(block_id) * p.stride
        parts.append(storages[p.storage][start:start + p.size].cpu())
    return torch.cat(parts).numpy().tobytes()


def block_keys(planner, block_hashes, num_groups: int, num_tokens: int) -> Dict[str, Tuple[int, int]]:
    """Every key the connector's ``planner`` gives a block of a request with these block
    hashes, mapped to (group, block index): a plan of the whole request over tables whose
    block ids encode the block index (id = index + 1; 0 is vLLM's null block)."""
    S = planner.scheduler_block_size
    blocks = -(-int(num_tokens) // S)
    tables = [[i + 1 for i in range(blocks)] for _ in range(num_groups)]
    plan = planner.plan_save(list(block_hashes), tables, int(num_tokens))
    return {key: (int(g), int(b) - 1) for key, g, b in plan.puts}


class LiveBlockRecorder:
    """After every engine step of an in-process engine, the bytes of every full block that
    vLLM still holds for each running request (its live block table: freed window blocks
    are vLLM's null block 0), per (request, group, block index): the KV those tokens had when
    they were computed, the reference every stored value must equal. A block's bytes never
    change while vLLM holds it for the request (asserted)."""

    def __init__(self, llm, layout, groups: Sequence[int]) -> None:
        self.sched = scheduler_of(llm)
        assert self.sched is not None, "LiveBlockRecorder needs an in-process engine"
        self.layout = layout
        self.groups = list(groups)
        self.block_size = int(self.sched.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        self.bytes: Dict[Tuple[str, int, int], bytes] = {}
        self.requests: Dict[str, object] = {}  # req id -> vLLM's Request (its block hashes)
        self.freed_seen = 0  # window blocks seen replaced by the null block

    def record(self) -> None:
        manager = self.sched.kv_cache_manager
        for rid, request in list(self.sched.requests.items()):
            if request.is_finished():
                continue
            self.requests[rid] = request
            computed = int(request.num_computed_tokens)
            tables = manager.get_block_ids(rid)
            for g in self.groups:
                bs = int(self.sched.kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size)
                for i, b in enumerate(tables[g]):
                    if (i + 1) * bs > computed:
                        break
                    if b == 0:
                        self.freed_seen += 1
                        continue
                    now = block_bytes(self.layout, g, b)
                    was = self.bytes.setdefault((rid, g, i), now)
                    assert was == now, f"request {rid} group {g} block {i} (id {b}) changed while vLLM held it"

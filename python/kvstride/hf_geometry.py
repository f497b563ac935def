"""A model's KV-cache geometry read from its Hugging Face ``config.json`` (a checkpoint folder,
the file itself, or a repository id in the local Hugging Face cache), for ``kvstride explain
--model`` and the trace replay: the groups vLLM runs an attention model with, their block size
and bytes.

What it derives, the way vLLM's KV-cache specs do (TP 1, the checkpoint's dtype, vLLM's default
16-token attention block): full-attention and sliding-window layers from ``layer_types`` (or
Gemma's ``sliding_window_pattern``, or a model-wide ``sliding_window``), MLA layers from
``kv_lora_rank``. Models with Mamba or linear-attention layers are refused, naming what works:
their state sizes and the hybrid block alignment are vLLM's arithmetic
(``scripts/derive_model_geometry.py`` derives them with vLLM's own classes).
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["config_path", "geometry_document"]

#: vLLM's attention block when nothing aligns it (CacheConfig's default; FlashAttention's multiple).
BLOCK = 16
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float8_e4m3fn": 1}
_LAYER_KINDS = {"full_attention": "full_attention", "attention": "full_attention", "global": "full_attention",
                "sliding_attention": "sliding_window", "sliding_window": "sliding_window", "local": "sliding_window"}
_STATE_LAYERS = ("linear_attention", "mamba", "mamba2", "conv", "ssm", "gated_delta_net")


def config_path(name_or_path: str) -> Optional[str]:
    """The ``config.json`` of the checkpoint folder, or of the cached Hugging Face repository,
    that ``name_or_path`` names; None when it names neither (a file names itself)."""
    folder = name_or_path if os.path.isdir(name_or_path) else None
    if folder is None and "/" in name_or_path and not name_or_path.endswith(".json"):
        from kvstride.identity import local_checkpoint

        found = local_checkpoint(name_or_path)
        folder = str(found) if found is not None and found.is_dir() else None
    if folder is not None and os.path.isfile(os.path.join(folder, "config.json")):
        return os.path.join(folder, "config.json")
    return None


def geometry_document(outer: dict, path: str) -> dict:
    """A geometry document (the form of ``python/kvstride/models/*.json``) from ``outer``, the
    Hugging Face config read from ``path``; ``ValueError`` naming what it cannot derive."""
    cfg = outer.get("text_config") or outer  # a multimodal model's language model
    if "num_hidden_layers" not in cfg:
        raise ValueError(f"{path}: neither a geometry (it has no 'groups') nor a Hugging Face config (no "
                         "num_hidden_layers)")
    name = outer.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    layers = int(cfg["num_hidden_layers"])
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or outer.get("torch_dtype") or "bfloat16")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{path}: dtype {dtype!r} is not one kvstride knows the size of; give a geometry JSON")
    width = _DTYPE_BYTES[dtype]
    kinds = _layer_kinds(cfg, layers, path)
    window = cfg.get("sliding_window")
    if "sliding_window" in kinds and not window:
        raise ValueError(f"{path}: sliding-window layers but no sliding_window size")
    if cfg.get("kv_lora_rank"):  # MLA: one latent and the rope part per token, every head
        per_token = (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)) * width
        kinds = ["mla" if kind == "full_attention" else kind for kind in kinds]
    else:
        heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        per_token = 2 * heads * head_dim * width  # K and V
    groups = []
    for kind in ("full_attention", "mla", "sliding_window"):
        count = kinds.count(kind)
        if not count:
            continue
        group = {"kind": kind, "block_size": BLOCK, "layers": count, "bytes_per_layer": BLOCK * per_token,
                 "bytes_per_block": BLOCK * per_token * count}
        if kind == "sliding_window":
            group["window"] = int(window)
        groups.append(group)
    counts = ", ".join(f"{g['layers']} {g['kind']}" for g in groups)
    return {
        "name": name,
        "groups": groups,
        "derivation": f"from {path}: {layers} layers ({counts}), {per_token} B of KV per token and layer ({dtype}), "
                      f"vLLM's {BLOCK}-token attention block, TP 1",
    }


def _layer_kinds(cfg: dict, layers: int, path: str) -> list:
    """Each layer's KV kind: ``layer_types`` when the config names them, else Gemma's pattern
    (every ``sliding_window_pattern``-th layer global), else one kind for every layer."""
    named = cfg.get("layer_types") or cfg.get("layers_block_type")
    if named:
        states = sorted({t for t in named if any(s in str(t) for s in _STATE_LAYERS)})
        if states:
            raise ValueError(
                f"{path}: layers of type {', '.join(states)} keep a state whose size and block alignment are "
                "vLLM's arithmetic: use a shipped geometry (kvstride explain --model qwen3-next-80b, nemotron-h) "
                "or derive a geometry JSON with scripts/derive_model_geometry.py"
            )
        unknown = sorted({str(t) for t in named if t not in _LAYER_KINDS})
        if unknown:
            raise ValueError(f"{path}: layer types {', '.join(unknown)} are not ones kvstride knows; give a geometry JSON")
        if len(named) != layers:
            raise ValueError(f"{path}: {len(named)} layer_types for {layers} layers")
        return [_LAYER_KINDS[t] for t in named]
    pattern = cfg.get("sliding_window_pattern")
    if pattern and cfg.get("sliding_window"):
        return ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_window" for i in range(layers)]
    sliding = cfg.get("sliding_window") and cfg.get("use_sliding_window", True)
    return ["sliding_window" if sliding else "full_attention"] * layers

"""Group mixes by name or by a compact text form, shared by the CLI's commands.

Text form: comma-separated groups, each ``kind:block_size`` followed by optional
``:name=value`` settings — ``window=<tokens>``, ``mode=align|all|none`` (mamba),
``cacheable=true|false``, ``heads=<num_kv_heads>``. A bare third field is the window:
``sliding_window:16:128`` equals ``sliding_window:16:window=128``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvstride._core import GroupSpec


@dataclass(frozen=True)
class Mix:
    name: str
    groups: tuple
    prefix_match_unit: Optional[int] = None
    note: str = ""


# Illustrative mixes of these model families' group kinds, at small block sizes that make their
# arithmetic easy to read; the block sizes vLLM really runs each model with are the shipped
# geometries' (``--model``, python/kvstride/models).
PRESETS = {
    "llama": ("full_attention:16", None, "one full-attention group (Llama-3)"),
    "gemma3": (
        "full_attention:32,sliding_window:32:window=1024",
        None,
        "Gemma-3: global layers plus 1024-token sliding-window layers",
    ),
    "gpt-oss": (
        "full_attention:32,sliding_window:32:window=128",
        None,
        "gpt-oss: alternating full and 128-token sliding-window attention",
    ),
    "qwen3-next": (
        "full_attention:64,mamba:256",
        None,
        "Qwen3-Next: gated attention plus linear-attention state in align mode",
    ),
    "nemotron-h": (
        "mamba:256,full_attention:32",
        None,
        "Nemotron-H: mostly Mamba-2 layers with a few attention layers",
    ),
    "glm-ring": (
        "full_attention:1152,circular_buffer:4,mamba:1152",
        64,
        "GLM-style: 1152-token attention blocks, a 4-token scratch ring and Mamba state "
        "(the mix that crashes vLLM's OffloadingConnector at boot or with islice step 0)",
    ),
}


def parse_group(text: str) -> GroupSpec:
    fields = [f.strip() for f in text.strip().split(":")]
    if len(fields) < 2 or not fields[0] or not fields[1]:
        raise ValueError(
            f"group {text!r}: write kind:block_size[:name=value...], "
            "e.g. full_attention:16 or sliding_window:16:window=128"
        )
    kind, size = fields[0], fields[1]
    try:
        block_size = int(size)
    except ValueError:
        raise ValueError(f"group {text!r}: block size {size!r} is not an integer") from None
    options = {}
    for extra in fields[2:]:
        name, sep, value = extra.partition("=")
        if not sep:
            name, value = "window", extra
        options[name.strip()] = value.strip()
    kwargs = {}
    for name, value in options.items():
        if name in ("window", "heads"):
            try:
                kwargs["window" if name == "window" else "num_kv_heads"] = int(value)
            except ValueError:
                raise ValueError(f"group {text!r}: {name}={value!r} is not an integer") from None
        elif name == "mode":
            kwargs["mamba_mode"] = value
        elif name == "cacheable":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"group {text!r}: cacheable={value!r}; use true or false")
            kwargs["prefix_cacheable"] = value.lower() in ("true", "1", "yes")
        else:
            raise ValueError(
                f"group {text!r}: unknown setting {name!r}; use window, mode, cacheable or heads"
            )
    return GroupSpec(kind, block_size, **kwargs)


def parse_groups(text: str) -> tuple:
    groups = tuple(parse_group(part) for part in text.split(",") if part.strip())
    if not groups:
        raise ValueError(f"no groups in {text!r}; e.g. full_attention:16,mamba:64")
    return groups


def format_group(group: GroupSpec) -> str:
    out = f"{group.kind}:{group.block_size}"
    if group.window is not None:
        out += f":window={group.window}"
    if group.kind == "mamba" and group.mamba_mode != "align":
        out += f":mode={group.mamba_mode}"
    if group.prefix_cacheable != (group.kind != "circular_buffer"):
        out += f":cacheable={'true' if group.prefix_cacheable else 'false'}"
    if group.num_kv_heads is not None:
        out += f":heads={group.num_kv_heads}"
    return out


def format_groups(groups) -> str:
    return ",".join(format_group(g) for g in groups)


def model_mix(name_or_path: str, prefix_match_unit: Optional[int] = None) -> Mix:
    """The group mix of a model geometry shipped in ``python/kvstride/models`` (or a JSON file
    of that form): the block sizes vLLM runs the model with."""
    from kvstride.trace import load_model

    model = load_model(name_or_path)
    return Mix(model.name, tuple(model.groups), prefix_match_unit, model.derivation)


def resolve_mix(preset: Optional[str], groups: Optional[str], prefix_match_unit: Optional[int]) -> Mix:
    """A preset, or ``--groups`` text; an explicit prefix_match_unit overrides the preset's."""
    if groups:
        return Mix("custom", parse_groups(groups), prefix_match_unit)
    name = preset or "llama"
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)} or --groups")
    text, unit, note = PRESETS[name]
    return Mix(name, parse_groups(text), prefix_match_unit if prefix_match_unit else unit, note)

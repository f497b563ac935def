"""What the connector reads from vLLM's configuration: the KV-cache groups as kvstride
:class:`~kvstride.GroupSpec` s, the fingerprint of everything a stored block's bytes depend
on, the tensor-parallel rank, ``kv_connector_extra_config``, and the key planner they make.
Configuration that cannot work is a ``ValueError`` here, at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional

import kvstride
from kvstride.identity import checkpoint_digest, code_digest, local_checkpoint, plain
from kvstride.engine import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_PUT_LINGER_S,
    DEFAULT_SAVE_WAIT_S,
    DEFAULT_STAGING_WAIT_S,
    check_load_timeout,
    check_lookup_timeout,
    check_put_linger,
    check_save_wait,
    check_staging_wait,
)
from kvstride import connector_checks
from kvstride.connector_checks import ADMISSION_POLICIES, KNOWN_KEYS, check_admission, check_known_keys
from kvstride.vllm.checks import check_strong_hash, warn_once
from kvstride.vllm.store_registry import StoreChoice, choose_store

__all__ = [
    "ConnectorConfig", "resolve_config", "group_specs", "model_identity", "ADMISSION_POLICIES", "check_admission",
    "KNOWN_KEYS", "check_known_keys", "BYTE_CACHE_FLAGS",
]

def group_specs(kv_cache_config, vllm_config, shared: bool = False) -> List[kvstride.GroupSpec]:
    """One :class:`kvstride.GroupSpec` per vLLM KV-cache group, in group order (``shared``: for a
    store other engines and ranks share, where head counts must be known)."""
    from vllm.v1 import kv_cache_interface as kci

    mamba_mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none") or "none"
    tp = max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))
    model_heads = _model_heads(vllm_config, kv_cache_config)
    out = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, heads = _group_spec_and_heads(g, group.kv_cache_spec, tp, model_heads, shared)
        bs = int(spec.block_size)
        if isinstance(spec, kci.CircularBufferSpec):
            out.append(kvstride.GroupSpec("circular_buffer", bs))
        elif isinstance(spec, kci.SlidingWindowSpec):  # incl. SlidingWindowMLASpec
            out.append(kvstride.GroupSpec("sliding_window", bs, window=int(spec.sliding_window), num_kv_heads=heads))
        elif isinstance(spec, kci.ChunkedLocalAttentionSpec):
            out.append(kvstride.GroupSpec("chunked_local", bs, window=int(spec.attention_chunk_size), num_kv_heads=heads))
        elif isinstance(spec, kci.MLAAttentionSpec):
            out.append(kvstride.GroupSpec("mla", bs))
        elif isinstance(spec, kci.FullAttentionSpec):
            out.append(kvstride.GroupSpec("full_attention", bs, num_kv_heads=heads))
        elif isinstance(spec, kci.MambaSpec):
            out.append(kvstride.GroupSpec("mamba", bs, mamba_mode=mamba_mode))
        else:
            raise ValueError(
                f"KV-cache group {g} has a {type(spec).__name__}, which kvstride cannot offload; "
                "supported: full attention, MLA, sliding window, chunked local, Mamba, circular buffer"
            )
    return out


def _group_spec_and_heads(g: int, spec, tp: int, model_heads: Optional[int], shared: bool):
    """A group's spec and its model's KV heads; a ``UniformTypeKVCacheSpecs`` (layers of one
    attention type whose pages differ, e.g. in head count) stands for its layers' type, with
    the fewest heads of them: keys are replicated over TP ranks that share a head, and that
    holds for all of its layers only while no layer has fewer heads than ranks. Heads that
    cannot be told are refused on a shared store (ranks holding different heads could share
    keys there); elsewhere every rank keys its own (None)."""
    members = getattr(spec, "kv_cache_specs", None)
    if not isinstance(members, dict) or not members:
        members = {"": spec}
    try:
        heads = {_total_kv_heads(member, tp, model_heads) for member in members.values()}
    except _AmbiguousHeads:
        if not shared:
            return next(iter(members.values())), None
        raise ValueError(
            f"KV-cache group {g} holds one KV head per rank at tensor_parallel_size={tp}, and the model config "
            "does not tell whether its heads are split over the ranks or replicated (the model's layers hold "
            "different head counts, or it names none): on a shared store ranks holding different heads could "
            "share keys; use store 'embedded', or a tensor_parallel_size that gives every attention layer more "
            "than one KV head per rank"
        ) from None
    known = sorted(h for h in heads if h is not None)
    if len(heads) > 1 and tp > 1 and (None in heads or known[0] < tp):
        raise ValueError(
            f"KV-cache group {g} mixes layers with {sorted(heads, key=str)} KV heads at tensor_parallel_size={tp}: "
            "kvstride keys a group's blocks for one head count; run with a tensor_parallel_size no larger than "
            "the fewest heads, or without the KVStrideConnector"
        )
    return next(iter(members.values())), (known[0] if known else None)


class _AmbiguousHeads(Exception):
    """A group's KV heads over the TP ranks cannot be told from vLLM's spec and the model config."""


def _model_heads(vllm_config, kv_cache_config) -> Optional[int]:
    """The model config's KV heads, when every attention layer's spec agrees with it (each holds
    ``max(1, heads // tp)`` per rank); None when the model config has none, or a layer holds
    another share (its layers' counts differ: the model config speaks for none of them)."""
    from vllm.v1 import kv_cache_interface as kci

    tp = max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))
    try:
        total = int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:
        return None
    if total < 1:
        return None
    for group in kv_cache_config.kv_cache_groups:
        members = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {"": group.kv_cache_spec}
        for spec in members.values():
            if isinstance(spec, kci.MLAAttentionSpec):  # one latent per rank: keyed replicated whatever the heads
                continue
            per_rank = getattr(spec, "num_kv_heads", None)
            if per_rank is not None and int(per_rank) != max(1, total // tp):
                return None
    return total


def _total_kv_heads(spec, tp: int, model_heads: Optional[int]) -> Optional[int]:
    """A group's KV heads over every TP rank (SEMANTICS §3 replicates keys over ``tp_size //
    heads``). vLLM's spec holds one rank's share, ``max(1, total // tp)``: with more than one
    head per rank the heads are split (the share times the ranks); with one, ``tp`` heads are
    split or fewer are replicated, which only the model config tells (``_model_heads``: when
    every layer agrees with it). Otherwise ``_AmbiguousHeads``."""
    per_rank = getattr(spec, "num_kv_heads", None)
    if per_rank is None:
        return None
    per_rank = int(per_rank)
    if tp == 1 or per_rank > 1:
        return per_rank * tp
    if model_heads is None:
        raise _AmbiguousHeads()
    return model_heads


def _refuse_unsupported_parallelism(parallel_config) -> None:
    """Pipeline and context parallelism shard the KV cache in ways the keys do not name yet:
    refused rather than stored under keys another shard would read."""
    for setting in ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"):
        value = int(getattr(parallel_config, setting, 1) or 1)
        if value > 1:
            raise ValueError(
                f"kvstride does not support {setting}={value} yet (its KV shards would be keyed as "
                f"one); run with {setting}=1, or without the KVStrideConnector"
            )


def _tp_rank(parallel_config, tp_size: int) -> int:
    """This worker's tensor-parallel rank."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no model-parallel group (a worker built outside vLLM's launcher)
        return int(getattr(parallel_config, "rank", 0) or 0) % tp_size


#: vLLM's cache settings that change the bytes a block or a state holds for the same tokens
#: (docs/SEMANTICS.md, "What a key binds"): KV and Mamba dtypes, layers kept unquantized, the
#: Mamba kernels that write the states, and layers that skip tokens (whose KV is then not
#: computed for every token). Where a setting is absent (another vLLM) it reads as None.
BYTE_CACHE_FLAGS = (
    "cache_dtype", "calculate_kv_scales", "kv_cache_dtype_skip_layers", "mamba_cache_dtype",
    "mamba_ssm_cache_dtype", "mamba_cache_mode", "mamba_block_size", "use_replayssm", "replayssm_buffer_len",
    "swa_bounded_replay", "kv_sharing_fast_prefill",
)


def _vllm_version() -> str:
    """The running vLLM's version, local build tag included (a CPU and a CUDA build compute
    with different kernels)."""
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # a vLLM without a version: keyed apart from every versioned one
        return "unknown"


def _fingerprint(vllm_config, kv_cache_config, groups) -> str:
    """16 hex chars describing everything in vLLM's configuration that a stored block's bytes
    depend on (the weights' and the model code's content is :func:`model_identity`'s, the
    worker's memory geometry the value header's: ``KVStore.bind_geometry``)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    desc = {  # the model's path is the namespace's (model_id), its content model_identity's
        "vllm": _vllm_version(),
        "revision": str(getattr(model, "revision", None)),
        "code_revision": str(getattr(model, "code_revision", None)),
        "quantization": str(getattr(model, "quantization", None)),
        "hf_overrides": plain(getattr(model, "hf_overrides", None)),
        "dtype": str(getattr(model, "dtype", "")),
        "cache": {flag: plain(getattr(cache, flag, None)) for flag in BYTE_CACHE_FLAGS},
        "hash": str(getattr(cache, "prefix_caching_hash_algo", "")),
        "groups": [
            [type(g.kv_cache_spec).__name__, repr(spec_g), int(getattr(g.kv_cache_spec, "page_size_bytes", 0)), list(g.layer_names)]
            for g, spec_g in zip(kv_cache_config.kv_cache_groups, groups)
        ],
    }
    return kvstride.layout_fingerprint(desc)


def _check_hf_overrides(vllm_config, extra: dict, shared: bool) -> None:
    """A callable ``hf_overrides`` changes the model in a way no configuration value shows: on a
    store that outlives the engine, the operator names the result (``model_identity``)."""
    overrides = getattr(vllm_config.model_config, "hf_overrides", None)
    if shared and callable(overrides) and "model_identity" not in extra:
        raise ValueError(
            f"hf_overrides is a callable ({plain(overrides)}), whose effect on the model kvstride cannot read: on a "
            "store other engines or restarts share, set kv_connector_extra_config['model_identity'] to a tag that "
            "changes whenever the callable or the weights do, or pass hf_overrides as a dict"
        )


def model_identity(vllm_config, extra: dict) -> str:
    """What the checkpoint contributes to the key namespace: the operator's
    ``kv_connector_extra_config["model_identity"]`` when set, else the digest of the checkpoint
    vLLM loads (:func:`kvstride.identity.checkpoint_digest`); with ``trust_remote_code``, the
    digest of the model code it runs too (:func:`kvstride.identity.code_digest`). Computed once
    per engine, by the scheduler's side: it plans every rank's keys."""
    model = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    reads_code = bool(getattr(model, "trust_remote_code", False))
    path = None  # the checkpoint on this host: found only where something is read from it
    if reads_code or extra.get("model_identity") is None:
        path = local_checkpoint(str(model.model), getattr(model, "revision", None), getattr(load, "download_dir", None))
    weights = _weights_identity(vllm_config, extra, path)
    if not reads_code:
        return weights
    if path is None or not path.is_dir():  # the code is not on this host to read: keyed as such
        return weights + "+code:unverified"
    return weights + "+code:" + code_digest(path)


def _weights_identity(vllm_config, extra: dict, path) -> str:
    explicit = extra.get("model_identity")
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit.strip():
            raise ValueError(
                f"kv_connector_extra_config['model_identity']={explicit!r}: give a non-empty string that "
                "changes whenever the weights do (a release tag), or leave it out to digest the checkpoint"
            )
        return "operator:" + explicit
    model = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(load, "load_format", "") or "")
    if load_format == "dummy":  # vLLM's seeded random weights: only the config decides them
        return "dummy:" + (checkpoint_digest(path, weights=False).digest if path is not None else str(model.model))
    if path is None:
        warn_once(
            "unverified-checkpoint",
            "kvstride: the checkpoint of model %r was not found on this host, so the store's keys cannot "
            "cover its weights: an engine with other weights under this name would share its KV; set "
            "kv_connector_extra_config['model_identity'] to a tag that changes with the weights",
            str(model.model), engine=vllm_config,
        )
        return "unverified:" + str(model.model)
    return "weights:" + checkpoint_digest(path).digest


@dataclass
class ConnectorConfig:
    """Everything both sides of the connector are built from."""

    extra: dict  # kv_connector_extra_config
    groups: List[kvstride.GroupSpec]
    fingerprint: str  # _fingerprint: the same on both sides; the value header's, with the geometry
    planner: kvstride.KeyPlanner  # this side's: the worker's rank, rank 0 on the scheduler
    rank_planners: List[kvstride.KeyPlanner]  # the scheduler's, one per TP rank it plans for
    tp_rank: int  # the rank this side keys as (0 on the arena, which keys as one rank)
    secret: Optional[bytes] = field(repr=False)  # never printed
    store: StoreChoice  # which store, and what its kind decides for the rest
    world_size: int
    save_wait_s: float = DEFAULT_SAVE_WAIT_S  # the workers' engines' (kvstride.engine)
    staging_wait_s: float = DEFAULT_STAGING_WAIT_S  # the workers' engines' (kvstride.engine)
    put_linger_s: float = DEFAULT_PUT_LINGER_S  # the workers' engines' (kvstride.engine)
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S  # the workers' engines' (kvstride.engine)
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S  # the scheduler's engine's (kvstride.engine)
    admission: str = "kvstride"  # one of ADMISSION_POLICIES
    # vLLM's prefix_cache_retention_interval: None dense checkpoints, 0 semantic only, T > 0 every T
    retention_interval: Optional[int] = 0
    # Requests one store call looks up: vLLM's max_num_seqs, the most one scheduling pass admits.
    lookup_batch: int = 256
    # model_identity(): the scheduler's, in every key it plans on a shared store; None on a
    # worker, which writes and reads only the keys the scheduler sends it
    model_identity: Optional[str] = None
    worker_rank: int = 0  # this worker's TP rank (its disk tier's file), 0 on the scheduler
    # A store that outlives this engine (Mooncake, the disk tier): each request's keys are bound
    # to its LoRA adapter's and multimodal items' content too (kvstride.vllm.bindings)
    binds_requests: bool = False
    trust_client_mm_uuids: bool = False  # kv_connector_extra_config's: vLLM's item identifiers as they are
    # vLLM's enable_prefix_caching as its platform left it: off, the attention backend may not
    # compute from a prefix it did not compute itself (MLA on vLLM's CPU backend), so no hit
    prefix_caching: bool = True
    # The planners of every rank for one request binding (None: the engine's own, rank_planners)
    planners_for: Optional[Callable[[Optional[str]], List[kvstride.KeyPlanner]]] = field(default=None, repr=False)


def resolve_config(vllm_config, kv_cache_config, worker: bool) -> ConnectorConfig:
    """The connector's configuration for one side (``worker``: this process holds KV tensors)."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    # What needs no engine first (kvstride check-config runs the same): the deployment key too,
    # keyed store keys and, on Mooncake, a MAC on every value.
    transfer = vllm_config.kv_transfer_config
    secret = connector_checks.check_extra(extra, getattr(transfer, "kv_load_failure_policy", None))
    trust_mm = extra.get("trust_client_mm_uuids", False)
    groups = group_specs(kv_cache_config, vllm_config, shared=str(extra.get("store", "embedded")) == "mooncake")
    vllm_h = getattr(kv_cache_config, "hash_block_size", None)
    # vLLM's hash block (its prefix_match_unit when one is set) is the unit kvstride keys by.
    S, H = kvstride.resolve_block_sizes(groups, prefix_match_unit=None if vllm_h is None else int(vllm_h))
    if vllm_h is not None and int(vllm_h) != H:
        raise ValueError(
            f"vLLM hashes blocks of {vllm_h} tokens but kvstride resolves H={H} for groups "
            f"{[(g.kind, g.block_size) for g in groups]}; the request block hashes would not line up"
        )
    fp = _fingerprint(vllm_config, kv_cache_config, groups)
    pc = vllm_config.parallel_config
    _refuse_unsupported_parallelism(pc)
    # Keys per TP rank (SEMANTICS §3), as many ranks as the store keys apart.
    # Which groups the core keys (never a scratch ring): the arena's slots need fit only theirs.
    keyed = kvstride.hashes_per_block(groups, H)
    store = choose_store(extra, kv_cache_config, max(1, int(getattr(pc, "tensor_parallel_size", 1) or 1)),
                         [g for g, per_block in enumerate(keyed) if per_block])
    if store.kind == "mooncake":
        check_strong_hash(vllm_config, extra, worker=worker)
    # Only a store other engines share, or a disk tier that outlives this engine, can meet
    # other weights (the arena alone lives and dies with its engine).
    shared = store.kind == "mooncake" or store.disk is not None or "model_identity" in extra
    _check_hf_overrides(vllm_config, extra, shared)
    identity = model_identity(vllm_config, extra) if shared and not worker else None
    key_fingerprint = fp if identity is None else kvstride.layout_fingerprint({"config": fp, "model": identity})
    tp_size = store.keyed_ranks
    tp_rank = _tp_rank(pc, tp_size) if worker and tp_size > 1 else 0

    def planner_of(rank: int, binding: Optional[str] = None) -> kvstride.KeyPlanner:
        fingerprint = key_fingerprint
        if binding is not None:  # a request's own content (kvstride.vllm.bindings): its own keys
            fingerprint = kvstride.layout_fingerprint({"engine": key_fingerprint, "request": binding})
        namespace = kvstride.Namespace(
            str(extra.get("model_id") or vllm_config.model_config.model),
            cache_prefix=extra.get("cache_prefix"),
            fingerprint=fingerprint,
            tp_rank=rank,
        )
        return kvstride.KeyPlanner(
            groups, hash_block_size=H, scheduler_block_size=S, namespace=namespace, tp_size=tp_size, tp_rank=rank,
            secret=secret,
        )

    planner = planner_of(tp_rank)
    # The scheduler plans every rank's saves and loads; a worker executes its own.
    rank_planners = [planner] + [planner_of(rank) for rank in range(1, tp_size)] if not worker else [planner]
    world_size = max(1, int(getattr(pc, "world_size", 1) or 1))
    save_wait_s = check_save_wait(extra.get("save_wait_s", DEFAULT_SAVE_WAIT_S))
    retention = getattr(vllm_config.cache_config, "prefix_cache_retention_interval", 0)
    max_num_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None) or 256
    return ConnectorConfig(
        extra, groups, fp, planner, rank_planners, tp_rank, secret, store, world_size, save_wait_s,
        put_linger_s=check_put_linger(extra.get("put_linger_s", DEFAULT_PUT_LINGER_S)),
        staging_wait_s=check_staging_wait(extra.get("staging_wait_s", DEFAULT_STAGING_WAIT_S)),
        load_timeout_s=check_load_timeout(extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S)),
        lookup_timeout_s=check_lookup_timeout(extra.get("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S)),
        admission=check_admission(extra.get("admission", "kvstride")),
        retention_interval=None if retention is None else int(retention), lookup_batch=max(1, int(max_num_seqs)),
        model_identity=identity,
        worker_rank=_tp_rank(pc, max(1, int(getattr(pc, "tensor_parallel_size", 1) or 1))) if worker else 0,
        binds_requests=shared, trust_client_mm_uuids=trust_mm,
        prefix_caching=bool(getattr(vllm_config.cache_config, "enable_prefix_caching", True)),
        planners_for=lambda binding: [planner_of(rank, binding) for rank in range(tp_size)],
    )

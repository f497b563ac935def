"""``kvstride simulate --trace``: replay a Mooncake-format request trace through the real core
(block hashes, keys, joint hits, load and save plans) and a capacity index
(:mod:`kvstride.capacity`) under one admission/eviction policy.

Trace format (Mooncake FAST'25): one JSON object per line with ``input_length`` (tokens) and
``hash_ids`` (one id per 512-token block of the input, a prefix chain: two requests share a
prefix exactly as far as their ids agree). Each id is mapped to 512 tokens derived from the id
alone (splitmix64 of ``id * 512 + position``, so equal ids give equal tokens and hence equal
vLLM block hashes at any hash block size). Hashes are computed once per distinct prefix node
(a trie over the id chains) and cached, as are the keys of each node's blocks.

Per request, in trace order: the lookup keys of the prompt (``KeyPlanner.lookup_keys``), one
existence call against the index, the longest joint hit (``longest_hit_bitmap``), the load plan
of that hit (``plan_load``; every key it gets is checked present: a reported hit every group
can serve), then the policy's saves (``plan_save`` for attention and window blocks, window
blocks only for the chosen boundaries' tails (SEMANTICS §8, ``plan_save(boundaries=...)``),
``KeyPlanner.key`` of the boundary hash for state checkpoints) into the index; a
``kvstride-boundary-sets`` boundary set is the keys of the core's load plan of a hit there.

Policies:

- ``dense``: today's behaviour: every attention and window block from the saved offset to the
  prompt's last full block, and the Mamba state at every block boundary (vLLM 0.32 hands off
  every retained full-block boundary state), in one LRU over values.
- ``vllm-reachable``: vLLM 0.33 OffloadingConnector's ``reachable_block_mask`` with its default
  ``prefix_cache_retention_interval = 0`` (vllm/config/cache.py:275): attention blocks all;
  window blocks only the tail a hit needs at the reachable boundaries and Mamba states only at
  them (vllm/v1/core/single_type_kv_cache_manager.py:1113-1131 sliding window, :1549-1606
  Mamba), the boundaries being ``num_prompt_tokens - 1`` and the request's
  ``shared_prefix_boundary`` (offloading/scheduler.py:1853-1857), each floored to the alignment
  (the full-attention chunk, scheduler.py:196-204), the prompt's end taken where a later
  request can share it, as for ``kvstride`` (below); one LRU over values.
- ``kvstride``: admission: the connector's rule (``KeyPlanner.hit_boundaries``, SEMANTICS §8):
  state checkpoints (and window tails) only at boundaries that can hit: the prompt's end and its
  resend boundary, vLLM's periodic checkpoints (``retention_interval``, 16384 tokens: two
  prompts sharing that much meet at one) and the deepest junction with a prefix seen before
  (boundary hashes the replay remembers, as the connector's scheduler does). A trace's partial
  last 512-token block is shared only by an exact repeat, so the rule runs on the prompt's
  whole trace blocks, what a later request can share, and one token past them: one end state
  per prompt, as the connector keeps for a real one. Attention blocks only up to the last boundary. Eviction: the embedded store's own order (:class:`kvstride.capacity.PrefixOrder`, which
  the arena's ``SlotIndex`` runs): GreedyDual-Size with frequency (a key's level is the clock
  plus how often loads read it, up to 4, times its request's worth: the prefill tokens a hit at
  its prompt's end saves per byte of that hit's boundary set, against the mean,
  ``value_weight``), at one level the least recently used request first, its deepest block
  first; a request's stamp and worth are taken at its lookup, and its hit's keys and its saves
  take them, as the connector's loads and saves do.

A disk tier (``disk_bytes``, ``--disk-bytes``): the ``kvstride`` policy's memory over a local
disk (:class:`kvstride.capacity.TieredIndex`), written through (every value memory stores is
written to disk at once) or spilled to (a value goes to disk when memory evicts it), the disk
evicting in its own ``PrefixOrder``. A lookup hits over what either tier holds, and a hit's values only the
disk holds are read back into memory; the result counts the disk's bytes written and read.

Not in ``all``: ``kvstride-admission`` (kvstride's admission with a per-value LRU) and
``kvstride-boundary-sets`` (the same admission with :class:`kvstride.capacity.BoundaryIndex`:
reference-counted boundary sets, lowest priority first: recency, reuse, prefill tokens saved
per byte), ablations of the eviction; the connector runs neither.

The next chat turn (``decode_states``, ``--decode-states``): vLLM 0.32 and 0.33 hand off no
decode-phase Mamba/GDN state (v1/core/single_type_kv_cache_manager.py:1533-1590, 1931,
1996-2008, 2066-2086 and kv_cache_coordinator.py:65-86 in 0.32), so a next turn hits at most up
to the previous prompt's checkpoints, with kvstride as with vLLM's own cache. The option models
a vLLM that hands off what a hit at each request's decode end needs (prompt + output tokens,
floored to the alignment). A trace carries no output tokens: a later request that passes
through all of an earlier prompt's full trace blocks and is at least that prompt and its output
long is taken as its next turn, and the earlier request's decode checkpoint is written then,
with its stamp (``decode_checkpoints`` counts them).

The replay, its trie and its report live together: each policy's bookkeeping reads the same
trie nodes, and the report names what the replay counted.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvstride import _core
from kvstride.capacity import (
    DISK_POLICIES,
    BoundaryIndex,
    Ghost,
    LRUIndex,
    PrefixIndex,
    PrefixOrder,
    TieredIndex,
    prefill_per_byte,
)

TRACE_BLOCK = 512
VOCAB = 150_000
POLICIES = ("dense", "vllm-reachable", "kvstride")
# Not in "all": kvstride's admission with other indexes (ablations of its eviction).
EXTRA_POLICIES = ("kvstride-admission", "kvstride-boundary-sets")
ATTENTION_KINDS = ("full_attention", "mla")
MODELS_DIR = os.path.join(os.path.dirname(__file__), "models")
DEFAULT_MODEL = "qwen3-next-80b"


# ---- model geometries ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelGeometry:
    name: str
    groups: tuple  # GroupSpec per KV-cache group (groups of one kind and size merged)
    bytes_per_block: tuple  # bytes one block of each group occupies (all its layers)
    layers: tuple
    derivation: str = ""

    @property
    def kinds(self) -> tuple:
        return tuple(g.kind for g in self.groups)


def list_models() -> List[str]:
    return sorted(f[:-5] for f in os.listdir(MODELS_DIR) if f.endswith(".json"))


def load_model(name_or_path: str) -> ModelGeometry:
    """A shipped geometry by name, a geometry JSON file, or a model's Hugging Face config (its
    checkpoint folder, its ``config.json``, or a repository id in the local cache)."""
    from kvstride.hf_geometry import config_path, geometry_document

    path = config_path(name_or_path) or name_or_path
    if not os.path.exists(path):
        path = os.path.join(MODELS_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
        what = "a folder without a config.json" if os.path.isdir(path) else "unknown model"
        raise ValueError(f"{what} {name_or_path!r}; use one of {', '.join(list_models())}, a checkpoint folder "
                         "or its config.json, a Hugging Face id in the local cache, or a geometry JSON file")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a model's config.json or geometry JSON ({err})") from None
    if "groups" not in doc:  # a Hugging Face config
        doc = geometry_document(doc, path)
    groups, sizes, layers = [], [], []
    for g in doc["groups"]:
        kwargs = {}
        if g.get("window") is not None:
            kwargs["window"] = int(g["window"])
        if g["kind"] == "mamba":
            kwargs["mamba_mode"] = g.get("mamba_mode", "align")
        groups.append(_core.GroupSpec(g["kind"], int(g["block_size"]), **kwargs))
        sizes.append(int(g["bytes_per_block"]))
        layers.append(int(g.get("layers", 0)))
    return ModelGeometry(doc.get("name", name_or_path), tuple(groups), tuple(sizes), tuple(layers), doc.get("derivation", ""))


# ---- trace -----------------------------------------------------------------------------------


@dataclass
class TraceRequest:
    input_length: int
    hash_ids: List[int]
    timestamp: float = 0.0
    output_length: int = 0


def read_trace(path: str, limit: Optional[int] = None) -> List[TraceRequest]:
    """The requests of a Mooncake-format trace file (gzip-compressed when its name ends in .gz)."""
    out = []
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
                ids = [int(i) for i in obj["hash_ids"]]
                length = int(obj.get("input_length", len(ids) * TRACE_BLOCK))
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{number}: not a Mooncake trace line ({err})") from None
            if length <= 0 or not ids:
                raise ValueError(f"{path}:{number}: input_length {length} with {len(ids)} hash_ids: a request needs "
                                 "tokens and at least one hash id")
            out.append(TraceRequest(length, ids, float(obj.get("timestamp", 0)), int(obj.get("output_length", 0))))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no requests (an empty trace)")
    return out


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def block_tokens(hash_id: int, seed: int = 0) -> np.ndarray:
    """The 512 tokens of trace block ``hash_id``: splitmix64 of ``id * 512 + i`` (+ seed)."""
    with np.errstate(over="ignore"):
        x = (np.uint64((hash_id * TRACE_BLOCK + seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
             + np.arange(TRACE_BLOCK, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(VOCAB - 1) + np.uint64(1)).astype(np.int64)


class PrefixTrie:
    """Distinct id-chain prefixes; per node the block hashes whose blocks end inside it."""

    def __init__(self, hasher, hash_block: int, seed: int = 0) -> None:
        self.hasher = hasher
        self.h = hash_block
        self.seed = seed
        self.children: Dict[Tuple[int, int], int] = {}
        self.parent: List[int] = []
        self.ids: List[int] = []
        self.depth: List[int] = []
        self.hashes: List[List[bytes]] = []
        self.touched: List[bool] = []
        self._tokens: Dict[int, np.ndarray] = {}
        self.keys: Dict[Tuple[int, int], List[str]] = {}  # (node, group) -> keys, cached by the replay

    def tokens(self, hash_id: int) -> np.ndarray:
        t = self._tokens.get(hash_id)
        if t is None:
            t = self._tokens[hash_id] = block_tokens(hash_id, self.seed)
        return t

    def path(self, hash_ids: Sequence[int]) -> List[int]:
        nodes, parent = [], -1
        children = self.children
        for depth, hid in enumerate(hash_ids):
            node = children.get((parent, hid))
            if node is None:
                node = self._add(parent, hid, depth, nodes)
            nodes.append(node)
            parent = node
        return nodes

    def _add(self, parent: int, hid: int, depth: int, ancestors: List[int]) -> int:
        h = self.h
        start = depth * TRACE_BLOCK
        last_end = start // h * h  # the last hash boundary at or before the node's start
        prev_hash = None
        if last_end:
            # the hash ending at last_end lives in the node holding token last_end - 1
            owner = ancestors[(last_end - 1) // TRACE_BLOCK]
            owner_first = -(-(self.depth[owner] * TRACE_BLOCK + 1) // h)  # index of its first hash end
            prev_hash = self.hashes[owner][last_end // h - owner_first]
        pieces = [ancestors_tokens for ancestors_tokens in (
            self.tokens(self.ids[ancestors[d]]) for d in range(last_end // TRACE_BLOCK, depth))]
        pieces.append(self.tokens(hid))
        tokens = np.concatenate(pieces)[last_end - (last_end // TRACE_BLOCK) * TRACE_BLOCK:]
        hashes = self.hasher.hash_blocks(tokens, h, parent=prev_hash) if len(tokens) >= h else []
        node = len(self.parent)
        self.children[(parent, hid)] = node
        self.parent.append(parent)
        self.ids.append(hid)
        self.depth.append(depth)
        self.hashes.append(hashes)
        self.touched.append(False)
        return node


# ---- replay ----------------------------------------------------------------------------------


@dataclass
class ReplayConfig:
    model: ModelGeometry
    capacity_bytes: int
    policy: str = "kvstride"
    algo: str = "sha256_cbor"
    seed: int = 0
    # kvstride: which boundaries get a checkpoint. "connector": the connector's own rule
    # (KeyPlanner.hit_boundaries, SEMANTICS §8: the prompt's end and resend boundary, vLLM's
    # periodic checkpoints every ``retention_interval`` tokens, the deepest junction with a
    # prefix seen before), over the tokens a later request of the trace can share: the prompt's
    # whole 512-token trace blocks and one token past them (TraceReplay._shared_prompt). Or, to weigh its
    # parts, a comma list of the prompt "end", the "hedge" (the last boundary ``hedge_tokens``
    # before the prompt end), the "junction", "every:T" tokens.
    checkpoints: str = "connector"
    retention_interval: Optional[int] = 16384  # vLLM's prefix_cache_retention_interval ("connector")
    hedge_tokens: int = TRACE_BLOCK
    # Model a vLLM that hands off what a hit at the end of each request's decode needs (the
    # state at prompt + output tokens, floored to the alignment): vLLM 0.32 and 0.33 hand off
    # no decode-phase Mamba state (module docstring). dense keeps every block boundary of the
    # decode, the kvstride policies its end; vllm-reachable's rule keeps none.
    decode_states: bool = False
    # kvstride: how much a request's prefill saved per byte counts against recency in the
    # eviction order (PrefixOrder's value_weight; 0: recency and reads alone).
    value_weight: float = PrefixOrder.VALUE_WEIGHT
    # kvstride: a local disk of this many bytes below the memory of ``capacity_bytes`` (0: none),
    # admitting by ``disk_policy`` (kvstride.capacity.TieredIndex: write-through or spill).
    disk_bytes: int = 0
    disk_policy: str = "write-through"
    check_servable: bool = True
    progress: bool = False
    # Called as on_hit(replay, index, hashes, hit) for every reported hit (tests check it
    # independently of the core).
    on_hit: Optional[object] = None
    # Called as on_request(position in the trace, hit tokens) for every request (analyses that
    # compare policies request by request, scripts/trace_loss_split.py).
    on_request: Optional[object] = None


def _bytes_text(n: float) -> str:
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{int(n)}B"


class TraceReplay:
    """Shared per model: the trie, the planner and cached keys; one :meth:`run` per policy and
    capacity."""

    def __init__(self, model: ModelGeometry, *, algo: str = "sha256_cbor", seed: int = 0) -> None:
        self.model = model
        groups = list(model.groups)
        self.s, self.h = _core.resolve_block_sizes(groups)
        fingerprint = _core.layout_fingerprint({"model": model.name, "S": self.s, "H": self.h, "algo": algo, "seed": seed})
        self.planner = _core.KeyPlanner(groups, hash_block_size=self.h, scheduler_block_size=self.s,
                                        namespace=_core.Namespace(model.name, fingerprint=fingerprint))
        self.a = self.planner.alignment
        self.trie = PrefixTrie(_core.BlockHasher(algo, seed=str(seed)), self.h, seed)
        self.groups = groups
        self.participating = [g for g, k in enumerate(self.planner.hashes_per_block) if k]
        self.fa = [g for g in self.participating if groups[g].kind in ATTENTION_KINDS]
        self.mambas = [g for g in self.participating if groups[g].kind == "mamba"]
        self.block = [g.block_size for g in groups]
        self.value_sizes = [(nbytes, g.kind) for nbytes, g in zip(model.bytes_per_block, groups)]  # per group
        self.ghost_grain = self.a * max(1, -(-256 // self.a))
        # the full-attention group whose block ends bound a hit (the cap below)
        self.cap_group = min(self.fa, key=lambda g: self.block[g]) if self.fa else None

    # -- per-request helpers -------------------------------------------------------------

    def _hashes(self, nodes: List[int], n: int) -> List[bytes]:
        out: List[bytes] = []
        hashes = self.trie.hashes
        for node in nodes:
            out.extend(hashes[node])
        del out[n // self.h:]
        return out

    def _lookup_tokens(self, nodes: List[int], n: int) -> int:
        """An upper bound on what can hit, from which prefix nodes ever had a value written:
        a hit X needs the attention block ending in the first never-written node (one that
        holds a block end), so X < (k + 1) * 512. Passing min(n, (k+1)*512 + 1) tokens to the
        lookup returns the same hit with far fewer keys for new prompts."""
        if self.cap_group is None:
            return n
        b = self.block[self.cap_group]
        touched, depth = self.trie.touched, self.trie.depth
        for node in nodes:
            d = depth[node]
            lo, hi = d * TRACE_BLOCK, (d + 1) * TRACE_BLOCK
            if (hi // b) * b > lo and not touched[node]:  # holds a block end, never written
                return min(n, hi + 1)
        return n

    def _fa_keys(self, nodes: List[int], hashes: List[bytes], g: int) -> List[str]:
        """The keys of group ``g``'s full blocks over ``hashes`` (index = block index), from a
        per-node cache (the blocks ending inside each trace block)."""
        b, h, key = self.block[g], self.h, self.planner.key
        full = len(hashes) * h
        cache, depth = self.trie.keys, self.trie.depth
        out: List[str] = []
        for node in nodes:
            lo = depth[node] * TRACE_BLOCK
            if lo >= full:
                break
            hi = lo + TRACE_BLOCK
            got = cache.get((node, g))
            if got is None:
                ends = range((lo // b + 1) * b, min(hi, full) + 1, b)
                got = [key(g, hashes[e // h - 1]) for e in ends]
                if hi <= full:
                    cache[(node, g)] = got
            out.extend(got)
        return out

    def _fa_prefix(self, nodes: List[int], hashes: List[bytes], exists) -> int:
        """Tokens of the longest prefix every full-attention group holds on its own (vLLM's
        single-group hit, whose end is the shared_prefix_boundary)."""
        best = None
        for g in self.fa:
            b = self.block[g]
            keys = self._fa_keys(nodes, hashes, g)
            present = exists(keys)
            run = 0
            for p in present:
                if not p:
                    break
                run += 1
            best = run * b if best is None else min(best, run * b)
        return best or 0

    # -- the run -------------------------------------------------------------------------

    def run(self, trace: Sequence[TraceRequest], cfg: ReplayConfig) -> dict:
        if cfg.policy not in POLICIES + EXTRA_POLICIES:
            raise ValueError(f"policy {cfg.policy!r}: use one of {', '.join(POLICIES + EXTRA_POLICIES)} or all")
        if cfg.disk_bytes < 0 or (cfg.disk_bytes and cfg.policy != "kvstride"):
            raise ValueError(f"disk_bytes={cfg.disk_bytes} with policy {cfg.policy!r}: give bytes >= 0; a disk tier "
                             "is modelled below the kvstride policy's memory (the embedded store) only")
        # The trie's "touched" marks are per run (what this run's index ever held).
        self.trie.touched = [False] * len(self.trie.touched)
        planner, trie, a, s, h = self.planner, self.trie, self.a, self.s, self.h
        groups = self.groups
        boundary_index = cfg.policy == "kvstride-boundary-sets"
        prefix_index = cfg.policy == "kvstride"
        if boundary_index:
            index = BoundaryIndex(cfg.capacity_bytes)
        elif cfg.disk_bytes:
            index = TieredIndex(cfg.capacity_bytes, cfg.disk_bytes, cfg.disk_policy, cfg.value_weight)
        else:
            index = PrefixIndex(cfg.capacity_bytes, cfg.value_weight) if prefix_index else LRUIndex(cfg.capacity_bytes)
        self.ghost = index.ghost if boundary_index else Ghost()
        stats = dict(requests=0, prompt_tokens=0, hit_tokens=0, unservable_hits=0, hits=0, truncated_inputs=0,
                     decode_checkpoints=0)
        # decode_states: requests whose next turn has not come yet, by the trie node of their
        # prompt's last full trace block: (prompt tokens, output tokens, stamp, worth, tokens stored).
        awaiting_next_turn: Dict[int, List[Tuple[int, int, Optional[int], float, int]]] = {}
        keeps_decode = cfg.decode_states and cfg.policy != "vllm-reachable"
        progress = None
        if cfg.progress:
            try:
                from tqdm import tqdm

                disk = f" + {_bytes_text(cfg.disk_bytes)} disk, {cfg.disk_policy}" if cfg.disk_bytes else ""
                progress = tqdm(total=len(trace), desc=f"{cfg.policy} @ {_bytes_text(cfg.capacity_bytes)}{disk}",
                                unit="req", file=sys.stderr, leave=False)
            except ImportError:
                progress = None
        started = time.perf_counter()
        for req in trace:
            n = min(req.input_length, len(req.hash_ids) * TRACE_BLOCK)
            if n < req.input_length:
                stats["truncated_inputs"] += 1
            nodes = trie.path(req.hash_ids)
            hashes = self._hashes(nodes, n)
            stats["requests"] += 1
            stats["prompt_tokens"] += n
            stamp = index.stamp() if prefix_index else None  # the connector's: one per request
            worth = 1.0
            if prefix_index and hashes:  # the connector's, from what a later request can share
                value = prefill_per_byte(planner, self._shareable(n, hashes), self.model.bytes_per_block)
                worth = index.order.worth(value)
            if awaiting_next_turn and hashes:
                stats["decode_checkpoints"] += self._save_decode_ends(cfg, index, awaiting_next_turn, req, nodes, hashes)
            hit = 0
            if hashes:
                n_look = self._lookup_tokens(nodes, n)
                keys = planner.lookup_keys(hashes, n_look) if n_look >= a else []
                if keys:
                    hit = planner.longest_hit_bitmap(hashes, n_look, index.exists(keys))
            if hit:
                tables = [list(range(1, -(-hit // self.block[g]) + 1)) for g in range(len(groups))]
                gets = planner.plan_load(hashes, tables, hit).gets
                got = [k for k, _g, _b in gets]
                if cfg.check_servable and not all(index.exists(got)):
                    stats["unservable_hits"] += 1
                    hit = 0
                else:
                    stats["hits"] += 1
                    if cfg.on_hit is not None:
                        cfg.on_hit(self, index, hashes, hit)
                    if boundary_index:
                        index.touch_boundary(hashes[hit // h - 1])
                    elif prefix_index:
                        index.touch(got, stamp, worth)
                    else:
                        index.touch(got)
            stats["hit_tokens"] += hit
            if cfg.on_request is not None:
                cfg.on_request(stats["requests"] - 1, hit)
            if hashes:
                stored = self._save(cfg, index, nodes, hashes, n, hit, stamp, worth)
                if keeps_decode and n >= TRACE_BLOCK and req.output_length > 0:
                    last_full = nodes[n // TRACE_BLOCK - 1]
                    awaiting_next_turn.setdefault(last_full, []).append((n, req.output_length, stamp, worth, stored))
            if progress is not None:
                progress.update(1)
        if progress is not None:
            progress.close()
        seconds = time.perf_counter() - started
        requests = stats["requests"]
        resident = index.resident()
        tiered = isinstance(index, TieredIndex)
        disk_written = index.disk.bytes_written if tiered else 0
        disk_read = index.disk_bytes_read if tiered else 0
        return {
            "policy": cfg.policy,
            "model": self.model.name,
            "groups": ",".join(f"{g.kind}:{g.block_size}" + (f":window={g.window}" if g.window else "") for g in groups),
            "S": s,
            "H": h,
            "capacity_bytes": cfg.capacity_bytes,
            "capacity": _bytes_text(cfg.capacity_bytes),
            "requests": requests,
            "prompt_tokens": stats["prompt_tokens"],
            "hit_tokens": stats["hit_tokens"],
            "token_hit_rate": stats["hit_tokens"] / stats["prompt_tokens"] if stats["prompt_tokens"] else 0.0,
            "hits": stats["hits"],
            "unservable_hits": stats["unservable_hits"],
            "bytes_written": index.bytes_written,
            "bytes_written_per_request": index.bytes_written / requests if requests else 0.0,
            "values_written": index.values_written,
            "evictions": index.evictions,
            "resident_bytes": index.used,
            "resident_bytes_by_kind": resident,
            "truncated_inputs": stats["truncated_inputs"],
            "decode_checkpoints": stats["decode_checkpoints"],
            "disk_bytes": cfg.disk_bytes,
            "disk": _bytes_text(cfg.disk_bytes) if cfg.disk_bytes else None,
            "disk_policy": cfg.disk_policy if cfg.disk_bytes else None,
            "disk_bytes_written": disk_written,
            "disk_bytes_written_per_request": disk_written / requests if requests else 0.0,
            "disk_bytes_read": disk_read,
            "disk_bytes_read_per_request": disk_read / requests if requests else 0.0,
            "disk_resident_bytes": index.disk.used if tiered else 0,
            "disk_evictions": index.disk.evictions if tiered else 0,
            "loads_from_disk": index.loads_from_disk if tiered else 0,
            "seconds": seconds,
        }

    def _save_decode_ends(self, cfg: ReplayConfig, index, awaiting: Dict[int, List[Tuple[int, int, Optional[int], float, int]]],
                          req: TraceRequest, nodes: List[int], hashes: List[bytes]) -> int:
        """``decode_states``: the decode-end checkpoints of the earlier requests ``req`` is the
        next turn of, written now that their tokens are known. A trace does not carry output
        tokens, so a request that passes through all of an earlier prompt's full trace blocks
        and is at least that prompt and its output long is taken as its next turn (the first
        such request; the trace's output tokens are those of this request). Each is written as
        the earlier request would have (its stamp and worth, from where its prompt's save ended). Returns
        how many."""
        written = 0
        for node in nodes:
            waiting = awaiting.get(node)
            if not waiting:
                continue
            left = []
            for n, output, stamp, worth, stored in waiting:
                x = (n + output) // self.a * self.a
                if req.input_length >= n + output and n < x <= len(hashes) * self.h:
                    self._save(cfg, index, nodes, hashes, x, stored, stamp, worth, decode_end=True)
                    written += 1
                elif req.input_length < n + output:
                    left.append((n, output, stamp, worth, stored))  # not its next turn: wait for another
            if left:
                awaiting[node] = left
            else:
                del awaiting[node]
        return written

    def _shareable(self, n: int, hashes: List[bytes]) -> int:
        """The tokens of a prompt of ``n`` a later request can share: its whole trace blocks (a
        partial last block's id recurs only in an exact repeat), as far as its hashes go."""
        return min(n // TRACE_BLOCK * TRACE_BLOCK, len(hashes) * self.h)

    @staticmethod
    def _shared_prompt(n: int, shareable: int) -> int:
        """The length of a prompt of ``n`` as an end-of-prompt rule sees it here: its
        ``shareable`` tokens (:meth:`_shareable`) and, if the prompt goes on, one token past
        them. A real next turn shares all of its previous prompt, a trace's next turn only its
        whole trace blocks, so each rule keeps its one end state where the trace's next turn
        can use it, not a second one a block below that only the trace's grain would make
        (SEMANTICS §8)."""
        return min(n, shareable + 1)

    def _save(self, cfg: ReplayConfig, index, nodes: List[int], hashes: List[bytes], n: int, hit: int,
              stamp: Optional[int], worth: float = 1.0, decode_end: bool = False) -> int:
        """Write what the policy keeps of a request of ``n`` tokens that hit ``hit`` (or, with
        ``decode_end``, of its decode, from ``hit``, what its prompt's save stored, to ``n``);
        returns the tokens stored from the start (the attention blocks' end)."""
        planner, a, s, h = self.planner, self.a, self.s, self.h
        groups, bpb = self.groups, self.model.bytes_per_block
        full = len(hashes) * h  # tokens with hashes
        offset = hit // s * s
        policy = cfg.policy
        # Boundaries whose hit sets this request writes.
        if decode_end:  # dense: every block boundary the decode crossed; the others: its end
            bounds = list(range((offset // s + 1) * s, n + 1, s)) if policy == "dense" else [n]
            end = n
        elif policy == "dense":
            bounds = list(range((offset // s + 1) * s, n // s * s + 1, s))
            end = n // s * s
        elif policy == "vllm-reachable":
            prompt = self._shared_prompt(n, self._shareable(n, hashes))
            cand = [(prompt - 1) // a * a]
            junction = self._fa_prefix(nodes, hashes, index.exists) if self.fa else 0
            if junction > hit:
                cand.append(min(junction, prompt - 1) // a * a)
            bounds = sorted({x for x in cand if x > hit and x <= full})
            end = n // s * s
        elif cfg.checkpoints == "connector":
            shareable = self._shareable(n, hashes)
            marks = planner.boundary_hashes(hashes, shareable)
            ghost = self.ghost
            seen = [ghost.seen(mark) for mark in marks]
            ghost.remember(marks)
            prompt = self._shared_prompt(n, shareable)
            admitted = planner.hit_boundaries(prompt, retention_interval=cfg.retention_interval, seen=seen) or []
            bounds = [x for x in admitted if x > hit]
            end = max(bounds) if bounds else 0
        else:
            p = n // a * a
            which = cfg.checkpoints.split(",")
            cand = []
            if "end" in which:
                cand.append(p)
                if n % a == 0:
                    cand.append(n - a)  # an exact repeat hits one alignment below its end
            if "hedge" in which:
                cand.append((n - cfg.hedge_tokens) // a * a)
            for item in which:  # "every:T": also a checkpoint every T tokens (floored to the alignment)
                if item.startswith("every:"):
                    step = max(a, int(item[6:]) // a * a)
                    cand.extend(range(step, p + 1, step))
            # The deepest junction with a prefix the index has seen pass before (ghost hashes
            # at a grain of at least 256 tokens; a request's remembered prefix is contiguous,
            # so a binary search finds the deepest seen one).
            grain = self.ghost_grain
            aligned = [hashes[x // h - 1] for x in range(grain, min(p, full) + 1, grain)]
            ghost = self.ghost
            if "junction" in which and aligned and ghost.seen(aligned[0]):
                lo, hi = 0, len(aligned) - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if ghost.seen(aligned[mid]):
                        lo = mid
                    else:
                        hi = mid - 1
                cand.append((lo + 1) * grain)
            bounds = sorted({x for x in cand if hit < x <= full})
            ghost.remember(aligned)
            end = max(bounds) if bounds else 0
        if not bounds and policy != "dense":
            return offset
        touched = self.trie.touched
        # Attention and window blocks: the core's normal save from the saved offset.
        tables = [list(range(1, -(-max(end, 1) // self.block[g]) + 2)) for g in range(len(groups))]
        # (key, bytes, kind, depth): depth the tokens its block ends at (the state's: its boundary)
        puts: List[Tuple[str, int, str, int]] = []
        if end > offset:
            # Window groups keep only the tails of the chosen boundaries (SEMANTICS §8).
            admitted = None if policy == "dense" else bounds
            sizes, block = self.value_sizes, self.block
            for key, g, block_id in planner.plan_save(hashes, tables, end, saved_offset=offset, boundaries=admitted).puts:
                nb, kind = sizes[g]
                puts.append((key, nb, kind, block_id * block[g]))  # table ids are 1-based
        for g in self.mambas:
            for x in bounds:
                puts.append((planner.key(g, hashes[x // h - 1]), bpb[g], "mamba", x))
        # Every trace block a value may be written in counts as touched (a superset is safe
        # for the lookup bound in _lookup_tokens).
        top = max([end] + bounds)
        for d in range(offset // TRACE_BLOCK, min(len(nodes), -(-top // TRACE_BLOCK))):
            touched[nodes[d]] = True
        if policy == "kvstride":
            index.put_many([(key, nb, kind, stamp, depth) for key, nb, kind, depth in puts], worth)
            return max(end, offset)
        if policy != "kvstride-boundary-sets":
            index.put_many([put[:3] for put in puts])
            return max(end, offset)
        # One boundary set per boundary: every key a hit there loads (the core's load plan:
        # attention blocks up to it, the window tail, the state).
        for x in bounds:
            gets = planner.plan_load(hashes, tables, x).gets
            index.put_boundary(hashes[x // h - 1], [(key, *self.value_sizes[g]) for key, g, _block in gets], float(x))
        return max(end, offset)


def replay(trace: Sequence[TraceRequest], model: ModelGeometry, capacities: Sequence[int],
           policies: Sequence[str], *, progress: bool = False, algo: str = "sha256_cbor", seed: int = 0,
           disk_bytes: int = 0, disk_policies: Sequence[str] = DISK_POLICIES, on_result=None,
           **kwargs) -> List[dict]:
    """One result per policy x capacity; with ``disk_bytes``, each followed by one per disk
    policy, that memory over a disk of ``disk_bytes``. ``on_result(result)`` is called as each
    one ends."""
    rp = TraceReplay(model, algo=algo, seed=seed)
    tiers = [{}] + [dict(disk_bytes=disk_bytes, disk_policy=p) for p in disk_policies if disk_bytes]
    out = []
    for policy in policies:
        for cap in capacities:
            for tier in tiers:
                out.append(rp.run(trace, ReplayConfig(model, cap, policy, algo=algo, seed=seed, progress=progress,
                                                      **tier, **kwargs)))
                if on_result is not None:
                    on_result(out[-1])
    return out

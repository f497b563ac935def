"""A slow, readable, pure-Python twin of the kvstride core (``kvstride._core``).

This module is the *oracle*: differential tests run the Rust core against it. It exposes
exactly the names and signatures of ``_core.pyi`` and follows ``SEMANTICS.md`` (the
normative text) line by line, favouring clarity over speed everywhere. Section numbers in
the comments (``§n``) refer to that document.

It is one file, longer than the project's others, on purpose: read top to bottom it is
SEMANTICS.md executed, one section after the other, and splitting it would scatter the rules
the differential tests hold the core to.

Notation (as in SEMANTICS.md):

- ``H``   hash block size: tokens covered by one chained hash. ``h[i]`` covers ``[0, (i+1)*H)``.
- ``S``   scheduler block size.
- ``B_g`` the *effective* block size of group ``g`` (``block_size * dcp`` for attention kinds,
          ``block_size`` for mamba). Everything below that talks about "blocks" of a group
          means blocks of ``B_g`` tokens.
- ``a``   lookup alignment: ``H`` with partial hits, ``S`` without.
- NULL block id = 0.

Only ``cbor2``, ``hashlib`` and ``xxhash`` (for ``xxhash_cbor``) are needed; ``numpy`` is
accepted as input but never required.
"""

import copy
import hashlib
import math
import operator
import os
from dataclasses import dataclass, field
from itertools import islice
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import cbor2

__all__ = [
    "BlockHasher",
    "cbor_encode",
    "GroupSpec",
    "resolve_block_sizes",
    "hashes_per_block",
    "stride_keys",
    "Namespace",
    "StoreSecret",
    "layout_fingerprint",
    "TailPlan",
    "SavePlan",
    "LoadPlan",
    "KeyPlanner",
    "dedup_gets",
]

NULL_BLOCK = 0

KINDS = ("full_attention", "mla", "sliding_window", "chunked_local", "mamba", "circular_buffer")
WINDOW_KINDS = ("sliding_window", "chunked_local")
FULL_KINDS = ("full_attention", "mla")
# Kinds keyed block by block like full attention. A circular_buffer only ever participates
# when no group is prefix-cacheable (§2); SEMANTICS gives it no rule of its own, so it is
# treated like full attention everywhere (save, tail, lookup, load): the one choice under
# which what is saved is exactly what a lookup asks for.
FULL_LIKE_KINDS = ("full_attention", "mla", "circular_buffer")
MAMBA_MODES = ("align", "all", "none")
HASH_ALGOS = ("sha256_cbor", "xxhash_cbor")


# =============================================================================================
# Small helpers: argument checking and integer arithmetic
# =============================================================================================


def _int(name: str, value: object) -> int:
    """``value`` as a Python int; TypeError for anything that is not an integer (bool too)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not bool ({value!r})")
    try:
        return operator.index(value)  # accepts int and numpy integers
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})") from None


def _positive_int(name: str, value: object) -> int:
    v = _int(name, value)
    if v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v}")
    return v


def _non_negative_int(name: str, value: object) -> int:
    v = _int(name, value)
    if v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v}")
    return v


def _bytes(name: str, value: object) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{name} must be bytes, got {type(value).__name__}")


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def _lcm(a: int, b: int) -> int:
    return a // math.gcd(a, b) * b


# =============================================================================================
# §1 Block hashes
# =============================================================================================


def cbor_encode(value: object) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding), exactly ``cbor2`` canonical.

    This is the reference: vLLM's ``sha256_cbor`` / ``xxhash_cbor`` are
    ``HASH(cbor2.dumps(x, canonical=True))``.
    """
    return cbor2.dumps(value, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # imported lazily: only needed for the xxhash_cbor algorithm

    # xxh3_128_digest gives the canonical (big-endian) byte order, as vLLM uses it.
    return xxhash.xxh3_128_digest(data)


_EXTRA_SCALARS = (str, int, bytes, bytearray, type(None), bool, float)


def _check_extra_value(value: object) -> None:
    """Extra keys hold str / int / bytes / None / bool / float and nested tuples (or lists)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            _check_extra_value(item)
    elif not isinstance(value, _EXTRA_SCALARS):
        raise TypeError(
            f"cannot hash a {type(value).__name__} ({value!r}): extra keys hold str, int, bytes, "
            "None, bool, float or nested tuples of them"
        )


def _extra_entry(index: int, entry: object):
    if entry is None:
        return None
    if not isinstance(entry, (tuple, list)):
        raise TypeError(f"extra_keys[{index}] is a {type(entry).__name__}; each entry is None or a tuple")
    _check_extra_value(entry)
    return entry


class BlockHasher:
    """Chained, vLLM-identical block hashes: ``h[i] = HASH(cbor([parent, tokens, extra]))``."""

    def __init__(self, algo: str = "sha256_cbor", seed: Optional[str] = None) -> None:
        if not isinstance(algo, str):
            raise TypeError(f"algo must be a str, got {type(algo).__name__}")
        if algo == "sha256_cbor":
            self._hash_fn = _sha256
            self._digest_size = 32
        elif algo == "xxhash_cbor":
            self._hash_fn = _xxh3_128
            self._digest_size = 16
        else:
            raise ValueError(f"unknown hash algorithm {algo!r}; use one of {', '.join(HASH_ALGOS)}")
        self._algo = algo

        # NONE_HASH: the "parent" of block 0.
        #   seed given -> HASH(cbor(seed))  (vLLM: hash_fn(PYTHONHASHSEED))
        #   no seed    -> 32 random bytes   (whatever the digest size, as vLLM does)
        if seed is None:
            self._none_hash = os.urandom(32)
        elif isinstance(seed, str):
            self._none_hash = self._hash_fn(cbor_encode(seed))
        else:
            raise TypeError(f"seed must be a str or None, got {type(seed).__name__}")

    @property
    def algo(self) -> str:
        return self._algo

    @property
    def none_hash(self) -> bytes:
        return self._none_hash

    @property
    def digest_size(self) -> int:
        return self._digest_size

    def __repr__(self) -> str:
        return f"BlockHasher(algo={self._algo!r})"

    def hash_blocks(
        self,
        token_ids,
        block_size: int,
        *,
        parent: Optional[bytes] = None,
        extra_keys: Optional[Sequence[Optional[tuple]]] = None,
    ) -> List[bytes]:
        """One hash per FULL block of ``block_size`` tokens (a trailing partial block gets none)."""
        block_size = _positive_int("block_size", block_size)
        if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
            raise TypeError("token_ids must be a list/tuple of ints or an integer numpy array, not str/bytes")
        tokens = [_int("token id", t) for t in token_ids]  # plain ints (numpy scalars too)
        num_full = len(tokens) // block_size

        if extra_keys is not None:
            extra_keys = list(extra_keys)
            if len(extra_keys) != num_full:
                raise ValueError(
                    f"extra_keys has {len(extra_keys)} entries but there are {num_full} full "
                    f"blocks of {block_size} tokens; give one entry (None or a tuple) per full block"
                )

        prev = self._none_hash if parent is None else _bytes("parent", parent)
        hashes: List[bytes] = []
        for i in range(num_full):
            block_tokens = tokens[i * block_size : (i + 1) * block_size]
            extra = None if extra_keys is None else _extra_entry(i, extra_keys[i])
            # The hash input is the 3-array [parent bytes, token array, extra (null or array)].
            prev = self._hash_fn(cbor_encode([prev, block_tokens, extra]))
            hashes.append(prev)
        return hashes

    def hash_blocks_batch(
        self,
        requests: Sequence,
        block_size: int,
        *,
        parents: Optional[Sequence[Optional[bytes]]] = None,
    ) -> List[List[bytes]]:
        """``hash_blocks`` for many requests (sequentially here; the core uses threads)."""
        requests = list(requests)
        if parents is None:
            parents = [None] * len(requests)
        else:
            parents = list(parents)
            if len(parents) != len(requests):
                raise ValueError(
                    f"parents has {len(parents)} entries for {len(requests)} requests; "
                    "give one parent (or None) per request, or parents=None"
                )
        return [self.hash_blocks(r, block_size, parent=p) for r, p in zip(requests, parents)]


# =============================================================================================
# §2 Group geometry
# =============================================================================================


class GroupSpec:
    """One KV-cache group: its kind, block size and the options its kind needs.

    Attributes are read-only once constructed (the values were validated).
    """

    __slots__ = ("_kind", "_block_size", "_window", "_mamba_mode", "_prefix_cacheable", "_num_kv_heads")

    def __init__(
        self,
        kind: str,
        block_size: int,
        *,
        window: Optional[int] = None,
        mamba_mode: str = "align",
        prefix_cacheable: Optional[bool] = None,
        num_kv_heads: Optional[int] = None,
    ) -> None:
        if not isinstance(kind, str):
            raise TypeError(f"kind must be a str, got {type(kind).__name__}")
        if kind not in KINDS:
            raise ValueError(f"unknown group kind {kind!r}; use one of {', '.join(KINDS)}")

        block_size = _positive_int("block_size", block_size)

        if kind in WINDOW_KINDS:
            if window is None:
                raise ValueError(f"a {kind} group needs window= (a positive number of tokens)")
            window = _positive_int("window", window)
        elif window is not None:
            _int("window", window)  # a wrong type is a TypeError even here
            raise ValueError(
                f"window={window!r} given for a {kind} group; window is only for "
                f"{' and '.join(WINDOW_KINDS)} groups, leave it None"
            )

        if not isinstance(mamba_mode, str):
            raise TypeError(f"mamba_mode must be a str, got {type(mamba_mode).__name__}")
        if mamba_mode not in MAMBA_MODES:
            raise ValueError(f"unknown mamba_mode {mamba_mode!r}; use one of {', '.join(MAMBA_MODES)}")

        if prefix_cacheable is None:
            prefix_cacheable = kind != "circular_buffer"  # the kind's default
        elif not isinstance(prefix_cacheable, bool):
            raise TypeError(f"prefix_cacheable must be a bool or None, got {type(prefix_cacheable).__name__}")

        if num_kv_heads is not None:
            num_kv_heads = _positive_int("num_kv_heads", num_kv_heads)

        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_block_size", block_size)
        object.__setattr__(self, "_window", window)
        object.__setattr__(self, "_mamba_mode", mamba_mode)
        object.__setattr__(self, "_prefix_cacheable", prefix_cacheable)
        object.__setattr__(self, "_num_kv_heads", num_kv_heads)

    def __setattr__(self, name, value):
        raise AttributeError(f"GroupSpec is immutable (tried to set {name})")

    kind = property(lambda self: self._kind)
    block_size = property(lambda self: self._block_size)
    window = property(lambda self: self._window)
    mamba_mode = property(lambda self: self._mamba_mode)
    prefix_cacheable = property(lambda self: self._prefix_cacheable)
    num_kv_heads = property(lambda self: self._num_kv_heads)

    def _fields(self):
        return (self._kind, self._block_size, self._window, self._mamba_mode,
                self._prefix_cacheable, self._num_kv_heads)

    def __eq__(self, other):
        if not isinstance(other, GroupSpec):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self) -> str:
        parts = [repr(self._kind), str(self._block_size)]
        if self._window is not None:
            parts.append(f"window={self._window}")
        if self._kind == "mamba":
            parts.append(f"mamba_mode={self._mamba_mode!r}")
        parts.append(f"prefix_cacheable={self._prefix_cacheable}")
        if self._num_kv_heads is not None:
            parts.append(f"num_kv_heads={self._num_kv_heads}")
        return f"GroupSpec({', '.join(parts)})"


def _check_groups(groups: Sequence[GroupSpec]) -> List[GroupSpec]:
    groups = list(groups)
    if not groups:
        raise ValueError("groups is empty; give at least one GroupSpec")
    for i, g in enumerate(groups):
        if not isinstance(g, GroupSpec):
            raise TypeError(f"groups[{i}] must be a GroupSpec, got {type(g).__name__}")
    return groups


def _effective_size(group: GroupSpec, dcp: int) -> int:
    """e_g: tokens one block of the group covers across the DCP ranks (mamba: not sharded)."""
    return group.block_size if group.kind == "mamba" else group.block_size * dcp


def _participating(groups: Sequence[GroupSpec]) -> List[bool]:
    """The prefix-cacheable groups, or all groups when none is (§2 step 4)."""
    cacheable = [g.prefix_cacheable for g in groups]
    return cacheable if any(cacheable) else [True] * len(groups)


def _check_multiples(groups, sizes, participating, H: int) -> None:
    """§2 step 5: every participating e_g must be a multiple of H."""
    bad = [i for i, (e, p) in enumerate(zip(sizes, participating)) if p and e % H != 0]
    if bad:
        named = ", ".join(f"group {i} ({groups[i].kind}, {sizes[i]} tokens)" for i in bad)
        part_sizes = [e for e, p in zip(sizes, participating) if p]
        g = 0
        for e in part_sizes:
            g = math.gcd(g, e)
        raise ValueError(
            f"hash block size H={H} does not divide the block size of {named}; every "
            f"prefix-cacheable group's block size must be a multiple of H: use an H that divides "
            f"all of {sorted(set(part_sizes))} (at most their gcd, {g}), or change those block sizes"
        )


def resolve_block_sizes(
    groups: Sequence[GroupSpec], *, prefix_match_unit: Optional[int] = None, dcp: int = 1
) -> Tuple[int, int]:
    """(S, H) for a set of groups, per SEMANTICS §2."""
    groups = _check_groups(groups)
    dcp = _positive_int("dcp", dcp)
    if prefix_match_unit is not None:
        prefix_match_unit = _positive_int("prefix_match_unit", prefix_match_unit)

    sizes = [_effective_size(g, dcp) for g in groups]

    # Step 1: a single group. Hits can only land on its block size.
    if len(groups) == 1:
        # SEMANTICS §2 rule 1 says block_size * dcp; for a lone mamba group we keep its
        # unsharded state size (rule 2's effective size), else no planner could key it.
        e = sizes[0]
        if prefix_match_unit is not None and prefix_match_unit != e:
            raise ValueError(
                f"prefix_match_unit={prefix_match_unit} with a single group "
                f"(group 0 ({groups[0].kind}, {e} tokens)): hits can only land on that group's "
                f"block size; use prefix_match_unit={e} or leave it None"
            )
        return e, e

    # Step 2: S = lcm over ALL groups (also the non-participating ones).
    S = 1
    for e in sizes:
        S = _lcm(S, e)

    participating = _participating(groups)

    # Step 3: any mamba group outside align mode only has a state at S boundaries.
    if any(g.kind == "mamba" and g.mamba_mode != "align" for g in groups):
        H = S  # prefix_match_unit is ignored here
    # Step 4: otherwise the requested unit or the gcd of the participating sizes.
    elif prefix_match_unit is not None:
        H = prefix_match_unit
    else:
        H = 0
        for e, p in zip(sizes, participating):
            if p:
                H = math.gcd(H, e)

    # Step 5: divisibility, participating groups only.
    _check_multiples(groups, sizes, participating, H)
    return S, H


def hashes_per_block(groups: Sequence[GroupSpec], hash_block_size: int, *, dcp: int = 1) -> List[int]:
    """e_g / H for participating groups, 0 for skipped ones (§2)."""
    groups = _check_groups(groups)
    H = _positive_int("hash_block_size", hash_block_size)
    dcp = _positive_int("dcp", dcp)
    sizes = [_effective_size(g, dcp) for g in groups]
    participating = _participating(groups)
    _check_multiples(groups, sizes, participating, H)
    return [e // H if p else 0 for e, p in zip(sizes, participating)]


# =============================================================================================
# §3 Striding and keys
# =============================================================================================


def stride_keys(block_hashes: Sequence[bytes], hashes_per_chunk: int, start_chunk: int = 0) -> List[bytes]:
    """The hash keying each complete chunk from ``start_chunk`` on: ``h[(j+1)*k - 1]``.

    Exactly ``islice(h, start*k + k - 1, None, k)``; ``k = 0`` (a skipped group) gives nothing.
    """
    k = _non_negative_int("hashes_per_chunk", hashes_per_chunk)
    start = _non_negative_int("start_chunk", start_chunk)
    if k == 0:
        return []
    return [_bytes("block hash", x) for x in islice(block_hashes, start * k + k - 1, None, k)]


def _agreed_rank(what: str, namespace_rank: Optional[int], planner_rank: Optional[int]) -> int:
    if namespace_rank is not None and planner_rank is not None and namespace_rank != planner_rank:
        raise ValueError(
            f"the KeyPlanner's {what}={planner_rank} disagrees with its Namespace's {what}={namespace_rank}: "
            "give the rank once (in the Namespace or to the planner), or the same in both"
        )
    for rank in (planner_rank, namespace_rank):
        if rank is not None:
            return rank
    return 0


class Namespace:
    """``[cache_prefix@]model[@fp:{fingerprint}]@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}``

    A TP or PP rank left None is the planner's to give (it reads as 0 in the text)."""

    def __init__(
        self,
        model: str,
        *,
        cache_prefix: Optional[str] = None,
        fingerprint: Optional[str] = None,
        tp_rank: Optional[int] = None,
        pcp_rank: int = 0,
        dcp_rank: int = 0,
        pp_rank: Optional[int] = None,
    ) -> None:
        if not isinstance(model, str):
            raise TypeError(f"model must be a str, got {type(model).__name__}")
        if cache_prefix is not None and not isinstance(cache_prefix, str):
            raise TypeError(f"cache_prefix must be a str or None, got {type(cache_prefix).__name__}")
        if fingerprint is not None and not isinstance(fingerprint, str):
            raise TypeError(f"fingerprint must be a str or None, got {type(fingerprint).__name__}")
        self.model = model
        self.cache_prefix = cache_prefix
        self.fingerprint = fingerprint
        self.tp_rank = None if tp_rank is None else _non_negative_int("tp_rank", tp_rank)
        self.pcp_rank = _non_negative_int("pcp_rank", pcp_rank)
        self.dcp_rank = _non_negative_int("dcp_rank", dcp_rank)
        self.pp_rank = None if pp_rank is None else _non_negative_int("pp_rank", pp_rank)

    def with_ranks(self, tp_rank: Optional[int], pp_rank: Optional[int]) -> "Namespace":
        """A copy with the planner's ranks set: a rank given on one side only is taken from
        there; given on both, they must agree (a silent pick would key one rank's shard under
        another rank's name)."""
        out = copy.copy(self)
        out.tp_rank = _agreed_rank("tp_rank", self.tp_rank, tp_rank)
        out.pp_rank = _agreed_rank("pp_rank", self.pp_rank, pp_rank)
        return out

    def text(self, tp_rank: Optional[int] = None, dcp_rank: Optional[int] = None) -> str:
        """The namespace string, optionally with another key tp_rank / dcp_rank."""
        t = (self.tp_rank or 0) if tp_rank is None else _non_negative_int("tp_rank", tp_rank)
        d = self.dcp_rank if dcp_rank is None else _non_negative_int("dcp_rank", dcp_rank)
        out = ""
        if self.cache_prefix:  # vLLM: [cache_prefix + "@"] only when the prefix is non-empty
            out += f"{self.cache_prefix}@"
        out += self.model
        if self.fingerprint:
            out += f"@fp:{self.fingerprint}"
        out += f"@tp_rank:{t}@pcp{self.pcp_rank}@dcp{d}@pp_rank:{self.pp_rank or 0}"
        return out

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"Namespace({self.text()!r})"


def layout_fingerprint(description: dict) -> str:
    """16 hex chars: SHA-256 of the canonical CBOR of a description of the deployment."""
    if not isinstance(description, dict):
        raise TypeError(f"description must be a dict, got {type(description).__name__}")
    return hashlib.sha256(cbor_encode(description)).hexdigest()[:16]


# =============================================================================================
# Plans (plain records)
# =============================================================================================


@dataclass
class TailPlan:
    outcome: str  # none | invalid_boundary | divergent_boundaries | hash_pending | all_present | planned
    boundary: Optional[int]
    puts: List[Tuple[str, int, int]] = field(default_factory=list)  # (key, group, block_id)


@dataclass
class SavePlan:
    end: int  # the saved offset once every put succeeded
    puts: List[Tuple[str, int, int]] = field(default_factory=list)  # (key, group, block_id)


@dataclass
class LoadPlan:
    hit: int  # m
    start: int  # floor(local_tokens / S) * S
    gets: List[Tuple[str, int, int]] = field(default_factory=list)  # (key, group, dest block_id)
    missing: List[Tuple[int, int]] = field(default_factory=list)  # (group, block index)


def _needed(group: GroupSpec, B: int, X: int) -> range:
    """needed(g, X) for window kinds (§6): blocks overlapping the tokens the next token
    (position X) attends to, i.e. ``[max(0, X - window + 1), X)`` for sliding_window and
    ``[floor(X / window) * window, X)`` for chunked_local. Empty for X <= 0."""
    if X <= 0:
        return range(0)
    if group.kind == "sliding_window":
        lo = max(0, X - group.window + 1)
    elif group.kind == "chunked_local":
        lo = (X // group.window) * group.window
    else:
        raise AssertionError("needed() is only for window kinds")
    if lo >= X:
        return range(0)
    return range(lo // B, (X - 1) // B + 1)


def dedup_gets(gets: Sequence[Tuple[str, int, int]]) -> Tuple[List[str], List[List[int]]]:
    """Unique keys in first-seen order, and for each the indices of ``gets`` it feeds."""
    keys: List[str] = []
    where: List[List[int]] = []
    index_of = {}
    for i, get in enumerate(gets):
        key = get[0]
        if key not in index_of:
            index_of[key] = len(keys)
            keys.append(key)
            where.append([])
        where[index_of[key]].append(i)
    return keys, where


# =============================================================================================
# Keyed BLAKE3 (SEMANTICS §3 "Keyed keys"): the reference algorithm, in plain Python
# =============================================================================================

_B3_IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
_B3_PERM = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_CHUNK_START, _CHUNK_END, _PARENT, _ROOT, _KEYED_HASH = 1, 2, 4, 8, 16
_DERIVE_KEY_CONTEXT, _DERIVE_KEY_MATERIAL = 32, 64
_M32 = 0xFFFFFFFF


def _b3_g(v, a, b, c, d, x, y):
    v[a] = (v[a] + v[b] + x) & _M32
    v[d] = v[d] ^ v[a]
    v[d] = ((v[d] >> 16) | (v[d] << 16)) & _M32
    v[c] = (v[c] + v[d]) & _M32
    v[b] = v[b] ^ v[c]
    v[b] = ((v[b] >> 12) | (v[b] << 20)) & _M32
    v[a] = (v[a] + v[b] + y) & _M32
    v[d] = v[d] ^ v[a]
    v[d] = ((v[d] >> 8) | (v[d] << 24)) & _M32
    v[c] = (v[c] + v[d]) & _M32
    v[b] = v[b] ^ v[c]
    v[b] = ((v[b] >> 7) | (v[b] << 25)) & _M32


def _b3_compress(cv, block_words, counter, block_len, flags):
    """The BLAKE3 compression function: 16 output words."""
    v = list(cv) + list(_B3_IV[:4]) + [counter & _M32, (counter >> 32) & _M32, block_len, flags]
    m = list(block_words)
    for r in range(7):
        _b3_g(v, 0, 4, 8, 12, m[0], m[1])
        _b3_g(v, 1, 5, 9, 13, m[2], m[3])
        _b3_g(v, 2, 6, 10, 14, m[4], m[5])
        _b3_g(v, 3, 7, 11, 15, m[6], m[7])
        _b3_g(v, 0, 5, 10, 15, m[8], m[9])
        _b3_g(v, 1, 6, 11, 12, m[10], m[11])
        _b3_g(v, 2, 7, 8, 13, m[12], m[13])
        _b3_g(v, 3, 4, 9, 14, m[14], m[15])
        if r < 6:
            m = [m[i] for i in _B3_PERM]
    return [v[i] ^ v[i + 8] for i in range(8)] + [v[i + 8] ^ cv[i] for i in range(8)]


def _b3_words(block: bytes):
    return [int.from_bytes(block[i : i + 4], "little") for i in range(0, 64, 4)]


def _blake3(data: bytes, key_words, flags: int, out_len: int) -> bytes:
    """BLAKE3 of ``data`` with chaining key ``key_words`` and mode ``flags``; ``out_len`` bytes."""
    chunks = [data[i : i + 1024] for i in range(0, len(data), 1024)] or [b""]
    stack = []  # chaining values of complete subtrees, merged like a binary counter

    def chunk_output(index, chunk):
        cv = list(key_words)
        blocks = [chunk[i : i + 64] for i in range(0, len(chunk), 64)] or [b""]
        for j, block in enumerate(blocks):
            f = flags | (_CHUNK_START if j == 0 else 0)
            if j == len(blocks) - 1:
                return cv, _b3_words(block.ljust(64, b"\0")), index, len(block), f | _CHUNK_END
            cv = _b3_compress(cv, _b3_words(block), index, 64, f)[:8]

    for index, chunk in enumerate(chunks[:-1]):
        cv = _b3_compress(*chunk_output(index, chunk))[:8]
        total = index + 1
        while total & 1 == 0:  # merge completed pairs of subtrees
            cv = _b3_compress(key_words, stack.pop() + cv, 0, 64, flags | _PARENT)[:8]
            total >>= 1
        stack.append(cv)
    output = chunk_output(len(chunks) - 1, chunks[-1])
    while stack:  # the root is the last node: fold the stack into it, right to left
        right = _b3_compress(*output)[:8]
        output = (list(key_words), stack.pop() + right, 0, 64, flags | _PARENT)
    cv, words, _, block_len, f = output
    out = b""
    for counter in range((out_len + 63) // 64):  # extendable output: the root, counter 0, 1, ...
        out += b"".join(w.to_bytes(4, "little") for w in _b3_compress(cv, words, counter, block_len, f | _ROOT))
    return out[:out_len]


def blake3_keyed(key: bytes, data: bytes, out_len: int = 32) -> bytes:
    """BLAKE3 in keyed mode (a 32-byte key): a PRF / MAC."""
    assert len(key) == 32
    return _blake3(data, _b3_words(key[:32] + b"\0" * 32)[:8], _KEYED_HASH, out_len)


def blake3_derive_key(context: str, material: bytes) -> bytes:
    """BLAKE3's key derivation: a 32-byte subkey of ``material`` for one ``context``."""
    context_key = _blake3(context.encode(), _B3_IV, _DERIVE_KEY_CONTEXT, 32)
    return _blake3(material, _b3_words(context_key + b"\0" * 32)[:8], _DERIVE_KEY_MATERIAL, 32)


_NAME_CONTEXT = "kvstride 2026-12 store key names"
_PAYLOAD_CONTEXT = "kvstride 2026-12 value payload tag AEGIS-128X2"
_MAC_CONTEXT = "kvstride 2026-12 value header mac"
_MIN_SECRET_BYTES = 32


def _check_secret(secret) -> bytes:
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    secret = bytes(secret)
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(
            f"the secret has {len(secret)} bytes; it needs at least {_MIN_SECRET_BYTES} "
            "(kvstride.secret.generate_secret_file writes one)"
        )
    return secret


def keyed_block_hash(secret: bytes, prefix: str, block_hash: bytes) -> bytes:
    """§3 "Keyed keys": the hash part of a key under a deployment secret,
    ``BLAKE3_keyed(k_name, u32_le(len(prefix)) || prefix || block_hash)``, as long as the
    block hash; ``prefix`` is ``"{namespace}@group:{g}@"``."""
    k_name = blake3_derive_key(_NAME_CONTEXT, secret)
    p = prefix.encode()
    return blake3_keyed(k_name, len(p).to_bytes(4, "little") + p + block_hash, len(block_hash))


# AEGIS-128X2 as a MAC (RFC 10032's AEGIS-MAC, 128-bit tag): the payload tag of the value MAC.
# Two AEGIS-128L lanes over one AES round, readable rather than fast; the Rust core uses the
# `aegis` crate (libaegis). Checked against the RFC's test vector (tests/test_secret_keys.py).


def _aes_tables():
    sbox, p, q = [0] * 256, 1, 1
    while True:  # the S-box from the multiplicative inverse and the affine map
        p = (p ^ (p << 1) ^ (0x1B if p & 0x80 else 0)) & 0xFF
        q ^= q << 1
        q ^= q << 2
        q ^= q << 4
        q &= 0xFF
        if q & 0x80:
            q ^= 0x09
        rot = lambda v, r: ((v << r) | (v >> (8 - r))) & 0xFF  # noqa: E731
        sbox[p] = q ^ rot(q, 1) ^ rot(q, 2) ^ rot(q, 3) ^ rot(q, 4) ^ 0x63
        if p == 1:
            break
    sbox[0] = 0x63
    tables = [[0] * 256 for _ in range(4)]
    for x in range(256):
        s = sbox[x]
        s2 = ((s << 1) ^ (0x1B if s & 0x80 else 0)) & 0xFF
        s3 = s2 ^ s
        col = (s2, s, s, s3)  # MixColumns' column for an input byte in row 0
        for r in range(4):  # row r: the column rotated down r places
            c = col[-r:] + col[:-r] if r else col
            tables[r][x] = c[0] | c[1] << 8 | c[2] << 16 | c[3] << 24
    return tables


_AES_T = _aes_tables()


def _aes_round(b, rk):
    """AESENC: ShiftRows, SubBytes, MixColumns, then XOR ``rk``. Blocks are 4 column words, row
    0 in the low byte."""
    t0, t1, t2, t3 = _AES_T
    return tuple(
        t0[b[c] & 0xFF] ^ t1[b[(c + 1) % 4] >> 8 & 0xFF] ^ t2[b[(c + 2) % 4] >> 16 & 0xFF] ^ t3[b[(c + 3) % 4] >> 24] ^ rk[c]
        for c in range(4)
    )


def _blk(data: bytes):
    return tuple(int.from_bytes(data[i : i + 4], "little") for i in range(0, 16, 4))


def _xor(a, b):
    return tuple(x ^ y for x, y in zip(a, b))


def _aegis_update(lane, m0, m1):
    """AEGIS-128L's state update on one lane (8 blocks): S'[i] = AESENC(S[i-1], S[i])."""
    new = [_aes_round(lane[i - 1], lane[i]) for i in range(8)]
    new[0], new[4] = _xor(new[0], m0), _xor(new[4], m1)
    lane[:] = new


def _aegis_finalize_lanes(lanes, u: bytes):
    for lane in lanes:
        t = _xor(_blk(u), lane[2])
        for _ in range(7):
            _aegis_update(lane, t, t)


def _aegis_tag(lane):
    t = lane[0]
    for i in range(1, 7):
        t = _xor(t, lane[i])
    return t


def aegis128x2_mac(key: bytes, data: bytes, nonce: bytes = bytes(16)) -> bytes:
    """AEGISMAC-128X2 of ``data`` with a 16-byte key and nonce: the 16-byte tag."""
    c0 = _blk(bytes.fromhex("000101020305080d1522375990e97962"))
    c1 = _blk(bytes.fromhex("db3d18556dc22ff12011314273b528dd"))
    k, n = _blk(key), _blk(nonce)
    lanes = []
    for i in range(2):  # lane i's context: its index and the degree less one
        lane = [_xor(k, n), c1, c0, c1, _xor(k, n), _xor(k, c0), _xor(k, c1), _xor(k, c0)]
        ctx = _blk(bytes([i, 1]) + bytes(14))
        for _ in range(10):
            lane[3], lane[7] = _xor(lane[3], ctx), _xor(lane[7], ctx)
            _aegis_update(lane, n, k)
        lanes.append(lane)
    padded = data + bytes(-len(data) % 64)
    for at in range(0, len(padded), 64):  # 64 bytes a step: lane i takes bytes 16i.. and 32+16i..
        for i, lane in enumerate(lanes):
            _aegis_update(lane, _blk(padded[at + 16 * i :]), _blk(padded[at + 32 + 16 * i :]))
    _aegis_finalize_lanes(lanes, (8 * len(data)).to_bytes(8, "little") + (128).to_bytes(8, "little"))
    tags = [_aegis_tag(lane) for lane in lanes]  # lane 1's tag joins lane 0's, then one more finalization
    zero = _blk(bytes(16))
    _aegis_update(lanes[0], tags[0], tags[1])
    _aegis_update(lanes[1], zero, zero)
    _aegis_finalize_lanes(lanes, (2).to_bytes(8, "little") + (128).to_bytes(8, "little"))
    return b"".join(w.to_bytes(4, "little") for w in _aegis_tag(lanes[0]))


class StoreSecret:
    """The value MAC of a deployment secret: a payload tag (a u64, where the XXH3-64 goes
    without a secret) and a 16-byte header MAC over key || length || tag."""

    def __init__(self, secret: bytes) -> None:
        secret = _check_secret(secret)
        self._payload = blake3_derive_key(_PAYLOAD_CONTEXT, secret)[:16]
        self._mac = blake3_derive_key(_MAC_CONTEXT, secret)

    def payload_tags(self, values) -> List[int]:
        """``u64_le(AEGISMAC-128X2(k_payload[:16], payload)[:8])`` (zero nonce, 128-bit tag) of
        each value (a list of parts)."""
        out = []
        for parts in values:
            data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            out.append(int.from_bytes(aegis128x2_mac(self._payload, data)[:8], "little"))
        return out

    def header_macs(self, keys, lengths, tags) -> List[bytes]:
        """``BLAKE3_keyed(k_mac, u32_le(len(key)) || key || u64_le(length) || u64_le(tag))[:16]``."""
        if not len(keys) == len(lengths) == len(tags):
            raise ValueError("keys, lengths and tags must have the same length")
        out = []
        for key, n, t in zip(keys, lengths, tags):
            k = key.encode()
            msg = len(k).to_bytes(4, "little") + k + int(n).to_bytes(8, "little") + int(t).to_bytes(8, "little")
            out.append(blake3_keyed(self._mac, msg, 16))
        return out

    def __repr__(self) -> str:
        return "StoreSecret(..)"


# =============================================================================================
# §3-§7 The planner
# =============================================================================================


class KeyPlanner:
    """Keys, save/tail/load plans and the joint hit for one rank of a deployment."""

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        *,
        hash_block_size: int,
        scheduler_block_size: int,
        namespace: Union[str, Namespace],
        partial_hits: Optional[bool] = None,
        dcp: int = 1,
        tp_size: int = 1,
        tp_rank: Optional[int] = None,
        pp_rank: Optional[int] = None,
        secret: Optional[bytes] = None,
    ) -> None:
        groups = _check_groups(groups)
        self._secret = None if secret is None else _check_secret(secret)
        H = _int("hash_block_size", hash_block_size)
        S = _int("scheduler_block_size", scheduler_block_size)
        dcp = _positive_int("dcp", dcp)
        tp_size = _positive_int("tp_size", tp_size)
        tp_rank = None if tp_rank is None else _non_negative_int("tp_rank", tp_rank)
        pp_rank = None if pp_rank is None else _non_negative_int("pp_rank", pp_rank)
        # The rank this planner keys as: given here, in the Namespace, or both (then equal).
        if isinstance(namespace, Namespace):
            namespace = namespace.with_ranks(tp_rank, pp_rank)
            tp_rank = namespace.tp_rank
        elif isinstance(namespace, str):
            if pp_rank:
                raise ValueError(
                    f"pp_rank={pp_rank} with a fixed namespace string: the string carries its own "
                    "pp_rank; pass a Namespace to key per PP rank"
                )
            tp_rank = tp_rank or 0
        if tp_rank is not None and tp_rank >= tp_size:
            raise ValueError(f"tp_rank={tp_rank} is out of range for tp_size={tp_size}; use 0..{tp_size - 1}")
        if H <= 0:
            raise ValueError(f"hash_block_size must be a positive int, got {H}")
        if S <= 0:
            raise ValueError(f"scheduler_block_size must be a positive int, got {S}")
        if S % H != 0:
            raise ValueError(
                f"scheduler_block_size={S} is not a multiple of hash_block_size={H}; "
                "use resolve_block_sizes() to get a consistent (S, H)"
            )

        sizes = [_effective_size(g, dcp) for g in groups]
        participating = _participating(groups)
        _check_multiples(groups, sizes, participating, H)
        bad = [i for i, (e, p) in enumerate(zip(sizes, participating)) if p and S % e != 0]
        if bad:
            named = ", ".join(f"group {i} ({groups[i].kind}, {sizes[i]} tokens)" for i in bad)
            raise ValueError(
                f"scheduler_block_size={S} is not a multiple of the block size of {named}; "
                "S must be a multiple of every prefix-cacheable group's block size "
                "(resolve_block_sizes() gives their lcm)"
            )

        if isinstance(namespace, str):
            if tp_size != 1:
                raise ValueError(
                    f"a str namespace cannot carry TP ranks (tp_size={tp_size}); "
                    "pass a Namespace so each group's key tp_rank can be set"
                )
        elif not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a str or a Namespace, got {type(namespace).__name__}")

        if partial_hits is None:
            partial_hits = any(g.kind == "mamba" and g.mamba_mode == "align" and g.block_size > H for g in groups)
        elif not isinstance(partial_hits, bool):
            raise TypeError(f"partial_hits must be a bool or None, got {type(partial_hits).__name__}")

        self._groups = groups
        self._sizes = sizes  # B_g, the effective block sizes
        self._namespace = namespace
        self._dcp = dcp
        self._tp_size = tp_size
        self._tp_rank = tp_rank

        self.hash_block_size = H
        self.scheduler_block_size = S
        self.hashes_per_block = [e // H if p else 0 for e, p in zip(sizes, participating)]
        self.partial_hits = partial_hits
        self.alignment = H if partial_hits else S

    # ---- small accessors -----------------------------------------------------------------

    def _group_index(self, group) -> int:
        g = _int("group", group)
        if not 0 <= g < len(self._groups):
            raise IndexError(f"group {g} is out of range; this planner has groups 0..{len(self._groups) - 1}")
        return g

    def _participates(self, g: int) -> bool:
        return self.hashes_per_block[g] > 0

    def replication(self, group: int) -> int:
        """How many TP ranks hold byte-identical data for this group (§3)."""
        g = self._group_index(group)
        spec = self._groups[g]
        if self._dcp > 1 or spec.kind == "mamba":
            return 1
        if spec.kind == "mla":
            return self._tp_size
        if spec.num_kv_heads is None:
            return 1
        return max(1, self._tp_size // spec.num_kv_heads)

    def _key_tp_ranks(self, g: int) -> range:
        """All key tp ranks some rank of the deployment loads group g from."""
        return range(_cdiv(self._tp_size, self.replication(g)))

    def _namespace_text(self, key_tp_rank: int) -> str:
        if isinstance(self._namespace, str):
            return self._namespace  # tp_size == 1 here, so key_tp_rank is 0
        if self._dcp > 1:
            # Under DCP every rank keys its own shard, and rank t is dcp rank t % dcp (vLLM).
            return self._namespace.text(key_tp_rank, dcp_rank=key_tp_rank % self._dcp)
        return self._namespace.text(key_tp_rank)

    def _key_in(self, g: int, block_hash: bytes, key_tp_rank: int) -> str:
        prefix = f"{self._namespace_text(key_tp_rank)}@group:{g}@"
        if self._secret is not None:  # §3 "Keyed keys"
            return prefix + keyed_block_hash(self._secret, prefix, block_hash).hex()
        return prefix + block_hash.hex()

    @property
    def keyed(self) -> bool:
        """True when keys are keyed with a deployment secret (§3 "Keyed keys")."""
        return self._secret is not None

    def key(self, group: int, block_hash: bytes) -> str:
        """This rank's key: ``{namespace with tp_rank // replication}@group:{g}@{hex}``."""
        g = self._group_index(group)
        return self._key_in(g, _bytes("block_hash", block_hash), self._tp_rank // self.replication(g))

    def key_bytes(self, group: int, block_hash: bytes) -> bytes:
        """hash || u32_be(group): vLLM's OffloadKey."""
        g = self._group_index(group)
        return _bytes("block_hash", block_hash) + g.to_bytes(4, "big")

    def _puts_block(self, g: int, b: int) -> bool:
        """TP put striding: this rank writes block b of g only when b % r == (tp_rank + g) % r."""
        r = self.replication(g)
        return b % r == (self._tp_rank + g) % r

    # ---- argument normalisation ---------------------------------------------------------

    def _hashes(self, block_hashes) -> List[bytes]:
        return [_bytes("block hash", x) for x in block_hashes]

    def _tables(self, block_ids) -> List[List[int]]:
        tables = [[_non_negative_int("block id", b) for b in table] for table in block_ids]
        if len(tables) != len(self._groups):
            raise ValueError(
                f"block_ids has {len(tables)} tables for {len(self._groups)} groups; give one block table per group"
            )
        return tables

    def _saved_offset(self, saved_offset) -> int:
        o = _int("saved_offset", saved_offset)
        S = self.scheduler_block_size
        if o < 0 or o % S != 0:
            raise ValueError(f"saved_offset={o} must be a non-negative multiple of scheduler_block_size={S}")
        return o

    @staticmethod
    def _block_id(table: List[int], b: int) -> Optional[int]:
        """Entry b of a block table, or None when it is NULL or beyond the table."""
        if b < len(table) and table[b] != NULL_BLOCK:
            return table[b]
        return None

    def _hash_at(self, hashes: List[bytes], tokens: int) -> bytes:
        """The hash covering exactly ``tokens`` tokens: h[tokens / H - 1]."""
        H = self.hash_block_size
        assert tokens > 0 and tokens % H == 0, (tokens, H)
        return hashes[tokens // H - 1]

    @staticmethod
    def _finish_puts(candidates, exists) -> Tuple[List[Tuple[str, int, int]], List[Tuple[str, int, int]]]:
        """Drop duplicate keys (first wins), then keys the store holds. Returns (deduped, remaining)."""
        seen = set()
        deduped = []
        for put in candidates:
            if put[0] not in seen:
                seen.add(put[0])
                deduped.append(put)
        held = set(exists) if exists is not None else set()
        return deduped, [put for put in deduped if put[0] not in held]

    # ---- §4 normal save -----------------------------------------------------------------

    def plan_save(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        saved_offset: int = 0,
        exists: Optional[Iterable[str]] = None,
        boundaries: Optional[Iterable[int]] = None,
    ) -> SavePlan:
        hashes = self._hashes(block_hashes)
        tables = self._tables(block_ids)
        n = _non_negative_int("num_tokens", num_tokens)
        o = self._saved_offset(saved_offset)
        H, S = self.hash_block_size, self.scheduler_block_size
        admitted = None
        if boundaries is not None:
            admitted = [_non_negative_int("boundary", x) for x in boundaries]
            for x in admitted:
                if x % self.alignment:
                    raise ValueError(
                        f"admitted boundary {x} is not a multiple of the alignment {self.alignment} "
                        "(use hit_boundaries)"
                    )

        # The save end: whole scheduler blocks whose hashes are known; never below the offset.
        end = max(o, (min(n, len(hashes) * H) // S) * S)

        candidates = []  # (key, group, block_id), by group then block
        for g, spec in enumerate(self._groups):
            if not self._participates(g):
                continue  # skipped everywhere
            B = self._sizes[g]
            if spec.kind in FULL_LIKE_KINDS:
                # Every whole block in [o, end).
                blocks = range(o // B, end // B)
            elif spec.kind in WINDOW_KINDS:
                # Only the blocks some lookup ending at an S-boundary X in (o, end] needs.
                wanted = set()
                for X in range(o + S, end + 1, S):
                    wanted.update(_needed(spec, B, X))
                if admitted is not None:
                    # §8: only the window tails of hit-capable boundaries.
                    wanted = {b for b in wanted if any(b in _needed(spec, B, X) for X in admitted)}
                blocks = sorted(b for b in wanted if b >= o // B)
            else:
                # mamba: its block table is never read (F8); state comes from hand-offs (§5).
                blocks = []
            for b in blocks:
                if not self._puts_block(g, b):
                    continue
                src = self._block_id(tables[g], b)
                if src is None:
                    continue
                # X is a multiple of S hence of B, so every needed block is whole here.
                key = self.key(g, self._hash_at(hashes, (b + 1) * B))
                candidates.append((key, g, src))

        _, puts = self._finish_puts(candidates, exists)
        return SavePlan(end=end, puts=puts)

    # ---- §8 admission --------------------------------------------------------------------

    def hit_boundaries(
        self, num_prompt_tokens: int, *, retention_interval: Optional[int], seen: Optional[Iterable[bool]] = None
    ) -> Optional[List[int]]:
        """The boundaries a later lookup can hit a prompt at, whose window tails its saves
        keep; None (every boundary) under dense retention (``retention_interval`` None)."""
        n = _non_negative_int("num_prompt_tokens", num_prompt_tokens)
        if retention_interval is None:
            return None
        interval = _non_negative_int("retention_interval", retention_interval)
        a = self.alignment
        out = set()
        if n > 0:
            out.add((n - 1) // a * a)  # a resend: its last token is computed (§6)
            out.add(n // a * a)  # a longer prompt extending this one
        if interval > 0:
            out.update(k * interval // a * a for k in range(1, n // interval + 1))
        seen = list(seen or ())
        deepest = max((i for i, s in enumerate(seen) if s), default=None)
        if deepest is not None:  # the junction: the deepest boundary seen before
            out.add(min((deepest + 1) * a, n // a * a))
        out.discard(0)
        return sorted(out)

    def boundary_hashes(self, block_hashes: Sequence[bytes], num_tokens: int) -> List[bytes]:
        """The hash naming each boundary ``a, 2a, ...`` up to ``num_tokens`` the hashes cover."""
        hashes = self._hashes(block_hashes)
        n = _non_negative_int("num_tokens", num_tokens)
        a, H = self.alignment, self.hash_block_size
        limit = min(n, len(hashes) * H)
        return [hashes[k * a // H - 1] for k in range(1, limit // a + 1)]

    # ---- §5 partial tail ----------------------------------------------------------------

    def plan_tail(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        handoffs: Sequence[Tuple[int, int, int]],
        *,
        saved_offset: int = 0,
        exists: Optional[Iterable[str]] = None,
    ) -> TailPlan:
        hashes = self._hashes(block_hashes)
        tables = self._tables(block_ids)
        o = _non_negative_int("saved_offset", saved_offset)  # §5 holds for any offset
        hand = []
        for item in handoffs:
            item = tuple(item)
            if len(item) != 3:
                raise ValueError(f"a hand-off is (group, block_id, boundary), got {item!r}")
            hand.append((_int("hand-off group", item[0]), _int("hand-off block_id", item[1]),
                         _int("hand-off boundary", item[2])))
        H, a = self.hash_block_size, self.alignment

        # Step 1: nothing to do.
        if not hashes or not hand:
            return TailPlan("none", None, [])

        boundaries = [bd for (_, _, bd) in hand]
        common = boundaries[0] if all(bd == boundaries[0] for bd in boundaries) else None

        # Step 2: every boundary must be reachable by a lookup.
        if any(bd <= 0 or bd % a != 0 for bd in boundaries):
            return TailPlan("invalid_boundary", common, [])
        # Step 3: one request, one boundary.
        if common is None:
            return TailPlan("divergent_boundaries", None, [])
        boundary = common
        # Step 4: its hash must be known.
        if boundary // H > len(hashes):
            return TailPlan("hash_pending", boundary, [])

        # Step 5: the candidate puts, group by group.
        candidates = []
        for g, spec in enumerate(self._groups):
            if not self._participates(g):
                continue
            B = self._sizes[g]
            last = _cdiv(boundary, B) - 1  # the block holding the boundary's last token
            if spec.kind == "mamba":
                # Last non-NULL hand-off for this group wins; the block table is never read.
                src = None
                for hg, hb, _ in hand:
                    if hg == g and hb != NULL_BLOCK:
                        src = hb
                if src is None or not self._puts_block(g, last):
                    continue
                candidates.append((self.key(g, self._hash_at(hashes, boundary)), g, src))
                continue
            lo = min(o // B, last)  # a tail re-puts at least the block holding the boundary
            if spec.kind in WINDOW_KINDS:
                blocks = [b for b in _needed(spec, B, boundary) if b >= lo]
            else:  # FULL_LIKE_KINDS
                blocks = range(lo, last + 1)
            for b in blocks:
                if not self._puts_block(g, b):
                    continue
                src = self._block_id(tables[g], b)
                if src is None:
                    continue
                end_b = min((b + 1) * B, boundary)  # the boundary sub-hash for a partial block
                candidates.append((self.key(g, self._hash_at(hashes, end_b)), g, src))

        # Step 6: dedupe, then drop what the store already holds.
        deduped, puts = self._finish_puts(candidates, exists)
        if puts:
            outcome = "planned"
        elif deduped:
            outcome = "all_present"
        else:
            outcome = "none"
        return TailPlan(outcome, boundary, puts)

    # ---- §6 lookup ----------------------------------------------------------------------

    def _consulted(self, g: int, X: int) -> List[int]:
        """Token counts t whose hash h[t/H - 1] group g's servability test at X consults."""
        spec, B = self._groups[g], self._sizes[g]
        if spec.kind == "mamba":
            return [X]  # only the last state matters; contiguity is not needed
        if spec.kind in WINDOW_KINDS:
            return [min((b + 1) * B, X) for b in _needed(spec, B, X)]
        # FULL_LIKE_KINDS: every whole block before X, then the partial block's sub-hash at X.
        ends = [(b + 1) * B for b in range(X // B)]
        if X % B != 0:
            ends.append(X)
        return ends

    def _limit(self, hashes: List[bytes], n: int) -> int:
        """T = floor(min(n, len(h)*H) / a) * a."""
        a = self.alignment
        return (min(n, len(hashes) * self.hash_block_size) // a) * a

    def lookup_keys(self, block_hashes: Sequence[bytes], num_tokens: int) -> List[str]:
        """Every key the hit test may consult, in every TP namespace some rank loads."""
        hashes = self._hashes(block_hashes)
        n = _non_negative_int("num_tokens", num_tokens)
        T = self._limit(hashes, n)
        H, a = self.hash_block_size, self.alignment

        keys: List[str] = []
        seen = set()
        for g in range(len(self._groups)):
            if not self._participates(g):
                continue
            # The union over X = a, 2a, ..., T of what the test at X consults.
            ends = set()
            if self._groups[g].kind in FULL_LIKE_KINDS:
                # Shortcut with the same result: the test at T consults every whole-block end
                # <= T, and each smaller X adds at most its own partial sub-hash X.
                B = self._sizes[g]
                ends.update(self._consulted(g, T))
                ends.update(X for X in range(a, T + 1, a) if X % B != 0)
            else:
                for X in range(a, T + 1, a):
                    ends.update(self._consulted(g, X))
            indices = {t // H - 1 for t in ends}
            for i in sorted(indices):  # by hash index, then key tp rank
                for t in self._key_tp_ranks(g):
                    key = self._key_in(g, hashes[i], t)
                    if key not in seen:
                        seen.add(key)
                        keys.append(key)
        return keys

    def _present_fn(self, hashes: List[bytes], present: set):
        """(g, token count) -> whether that key exists in every TP namespace some rank loads."""
        def is_present(g: int, tokens: int) -> bool:
            h = self._hash_at(hashes, tokens)
            return all(self._key_in(g, h, t) in present for t in self._key_tp_ranks(g))
        return is_present

    def _servable(self, g: int, X: int, is_present) -> bool:
        """§6, literally: every key the test for group g at X consults is present."""
        if X == 0:
            return True
        # Checked from the largest token count down: a miss is usually near X, so a failing
        # X fails fast (same answer as checking in any order).
        return all(is_present(g, t) for t in reversed(self._consulted(g, X)))

    def _best(self, hashes: List[bytes], T: int, is_present) -> int:
        """The largest multiple X of a with 0 <= X <= T that every participating group serves."""
        a = self.alignment
        groups = [g for g in range(len(self._groups)) if self._participates(g)]

        # For full-attention-like groups the literal test is O(X / B) per X, which makes a
        # long request quadratic. An equivalent form: "every whole-block end <= X present" is
        # "X // B <= the number of leading blocks whose end key is present", counted once.
        leading = {}

        def leading_blocks(g: int) -> int:
            if g not in leading:
                B, k = self._sizes[g], 0
                while (k + 1) * B <= T and is_present(g, (k + 1) * B):
                    k += 1
                leading[g] = k
            return leading[g]

        def servable(g: int, X: int) -> bool:
            if self._groups[g].kind in FULL_LIKE_KINDS:
                B = self._sizes[g]
                return X // B <= leading_blocks(g) and (X % B == 0 or is_present(g, X))
            return self._servable(g, X, is_present)

        X = (T // a) * a if T > 0 else 0
        while X > 0:
            if all(servable(g, X) for g in groups):
                return X
            X -= a
        return 0

    def longest_hit(self, block_hashes: Sequence[bytes], num_tokens: int, present: Iterable[str]) -> int:
        hashes = self._hashes(block_hashes)
        n = _non_negative_int("num_tokens", num_tokens)
        is_present = self._present_fn(hashes, set(present))
        a, H = self.alignment, self.hash_block_size

        hit = self._best(hashes, self._limit(hashes, n), is_present)
        if hit >= n and n > 0:
            # Nothing would be left to compute: retry below n with the same existence results.
            T2 = (min(n - 1, len(hashes) * H) // a) * a
            hit = self._best(hashes, T2, is_present)
        return hit if n > 0 else 0

    def longest_hit_bitmap(self, block_hashes: Sequence[bytes], num_tokens: int, bitmap: Sequence[bool]) -> int:
        """``longest_hit`` with ``bitmap[i]`` = whether ``lookup_keys(...)[i]`` exists."""
        keys = self.lookup_keys(block_hashes, num_tokens)
        bits = list(bitmap)
        if len(bits) != len(keys):
            raise ValueError(
                f"bitmap has {len(bits)} entries but lookup_keys() gave {len(keys)} keys; "
                "give one entry per key, in the same order"
            )
        present = {k for k, bit in zip(keys, bits) if bit}
        return self.longest_hit(block_hashes, num_tokens, present)

    # ---- §7 load plan -------------------------------------------------------------------

    def saved_offset_after_load(self, hit_tokens: int) -> int:
        """A request's saved offset once a load of ``hit_tokens`` completed: the loaded prefix
        is in the store, so its saves start at the last scheduler block it covers."""
        S = self.scheduler_block_size
        return _non_negative_int("hit_tokens", hit_tokens) // S * S

    def hit_set_blocks(self, hit_tokens: int) -> List[int]:
        """Per group, how many values a load of a hit of ``hit_tokens`` reads with nothing
        local: the hit's boundary set, what the store must hold for it (0 where the group takes
        no part, and everywhere for a hit of 0). The sizes of ``plan_load``'s gets from 0."""
        m = _non_negative_int("hit_tokens", hit_tokens)
        out = []
        for g, spec in enumerate(self._groups):
            B = self._sizes[g]
            if m == 0 or not self._participates(g):
                out.append(0)
            elif spec.kind == "mamba":
                out.append(1)  # the state at m
            elif spec.kind in WINDOW_KINDS:
                out.append(len(_needed(spec, B, m)))  # the window's tail before m
            else:
                out.append(_cdiv(m, B))  # every block up to the one holding m
        return out

    def plan_load(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        hit_tokens: int,
        *,
        local_tokens: int = 0,
    ) -> LoadPlan:
        hashes = self._hashes(block_hashes)
        tables = self._tables(block_ids)
        m = _int("hit_tokens", hit_tokens)
        c = _int("local_tokens", local_tokens)
        H, S, a = self.hash_block_size, self.scheduler_block_size, self.alignment
        if m < 0 or m % a != 0:
            raise ValueError(f"hit_tokens={m} must be a non-negative multiple of the alignment {a}")
        if m > len(hashes) * H:
            raise ValueError(
                f"hit_tokens={m} is beyond the {len(hashes)} known hashes ({len(hashes) * H} tokens)"
            )
        if c < 0 or c > m:
            raise ValueError(f"local_tokens={c} must be between 0 and hit_tokens={m}")

        start = (c // S) * S
        gets: List[Tuple[str, int, int]] = []
        missing: List[Tuple[int, int]] = []
        for g, spec in enumerate(self._groups):
            if not self._participates(g):
                continue
            B = self._sizes[g]
            first = start // B
            if spec.kind == "mamba":
                # The single block holding the state at m (nothing when the hit adds nothing).
                if m > start:
                    blocks = [(_cdiv(m, B) - 1, m)]
                else:
                    blocks = []
            elif spec.kind in WINDOW_KINDS:
                blocks = [(b, min((b + 1) * B, m)) for b in _needed(spec, B, m) if b >= first]
            else:
                # FULL_LIKE_KINDS: every block from the start to the one holding m.
                blocks = [(b, min((b + 1) * B, m)) for b in range(first, _cdiv(m, B))]
            for b, tokens in blocks:
                dest = self._block_id(tables[g], b)
                if dest is None:
                    missing.append((g, b))
                    continue
                gets.append((self.key(g, self._hash_at(hashes, tokens)), g, dest))
        return LoadPlan(hit=m, start=start, gets=gets, missing=missing)

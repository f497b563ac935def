"""Type stubs for the Rust core (``kvstride._core``). Semantics: SEMANTICS.md."""

from typing import Any, Iterable, List, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

TokenIds = Union[Sequence[int], npt.NDArray[np.integer]]
ExtraKey = Optional[tuple]

# ---- hashing (SEMANTICS §1) -------------------------------------------------

class BlockHasher:
    """Chained, vLLM-identical block hashes: HASH(cbor([parent, tokens, extra]))."""

    def __init__(self, algo: str = "sha256_cbor", seed: Optional[str] = None) -> None: ...
    @property
    def algo(self) -> str: ...
    @property
    def none_hash(self) -> bytes: ...
    @property
    def digest_size(self) -> int: ...
    def hash_blocks(
        self,
        token_ids: TokenIds,
        block_size: int,
        *,
        parent: Optional[bytes] = None,
        extra_keys: Optional[Sequence[ExtraKey]] = None,
    ) -> list[bytes]:
        """One hash per FULL block of ``block_size`` tokens; the GIL is released."""
    def hash_blocks_batch(
        self,
        requests: Sequence[TokenIds],
        block_size: int,
        *,
        parents: Optional[Sequence[Optional[bytes]]] = None,
    ) -> list[list[bytes]]:
        """``hash_blocks`` for many requests at once, in parallel threads."""

def cbor_encode(value: object) -> bytes:
    """Canonical CBOR of a value made of the kinds a hash input may hold (tests, tooling)."""

# ---- geometry (SEMANTICS §2) ------------------------------------------------

class GroupSpec:
    def __init__(
        self,
        kind: str,
        block_size: int,
        *,
        window: Optional[int] = None,
        mamba_mode: str = "align",
        prefix_cacheable: Optional[bool] = None,
        num_kv_heads: Optional[int] = None,
    ) -> None: ...
    kind: str
    block_size: int
    window: Optional[int]
    mamba_mode: str
    prefix_cacheable: bool
    num_kv_heads: Optional[int]

def resolve_block_sizes(
    groups: Sequence[GroupSpec], *, prefix_match_unit: Optional[int] = None, dcp: int = 1
) -> tuple[int, int]: ...
def hashes_per_block(
    groups: Sequence[GroupSpec], hash_block_size: int, *, dcp: int = 1
) -> list[int]:
    """e_g / H for participating groups, 0 for skipped ones."""

# ---- striding and keys (SEMANTICS §3) ---------------------------------------

def stride_keys(
    block_hashes: Sequence[bytes], hashes_per_chunk: int, start_chunk: int = 0
) -> list[bytes]: ...

class Namespace:
    """``[cache_prefix@]model[@fp:{fingerprint}]@tp_rank:{t}@pcp{p}@dcp{d}@pp_rank:{pp}``

    A TP or PP rank left None is the KeyPlanner's to give (it reads as 0 in the text)."""

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
    ) -> None: ...
    def text(self, tp_rank: Optional[int] = None, dcp_rank: Optional[int] = None) -> str:
        """The namespace string, optionally with another key tp_rank / dcp_rank. Empty
        cache_prefix / fingerprint are left out, as vLLM does."""

def layout_fingerprint(description: dict) -> str:
    """16 hex chars: SHA-256 of the canonical CBOR of a description of the deployment
    (dtype, block sizes, layout, hash algorithm, seed ...)."""

# ---- planning (SEMANTICS §3-§7) ---------------------------------------------

class TailPlan:
    outcome: str  # none | invalid_boundary | divergent_boundaries | hash_pending | all_present | planned
    boundary: Optional[int]
    puts: list[tuple[str, int, int]]  # (key, group, block_id), by group then block

class SavePlan:
    end: int  # the saved offset once every put succeeded
    puts: list[tuple[str, int, int]]  # (key, group, block_id), by group then block

class LoadPlan:
    hit: int  # tokens the plan makes available (m)
    start: int  # floor(local_tokens / S) * S
    gets: list[tuple[str, int, int]]  # (key, group, destination block_id)
    missing: list[tuple[int, int]]  # (group, block index) whose destination is NULL / absent

class KeyPlanner:
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
        """``tp_rank`` / ``pp_rank``: this rank, given here or in the Namespace (None on both
        sides: 0). Given on both sides they must agree, else ``ValueError``. A str namespace
        takes no ``pp_rank`` (its text carries one). ``secret`` (>= 32 bytes): every key's hash
        part is keyed (SEMANTICS §3 "Keyed keys"); None: keys as without it."""
    keyed: bool  # keys are keyed with a secret
    hashes_per_block: list[int]
    hash_block_size: int
    scheduler_block_size: int
    partial_hits: bool
    alignment: int  # H with partial hits, S without
    def replication(self, group: int) -> int: ...
    def key(self, group: int, block_hash: bytes) -> str: ...
    def key_bytes(self, group: int, block_hash: bytes) -> bytes:
        """hash || u32_be(group): vLLM's OffloadKey."""
    def plan_save(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        *,
        saved_offset: int = 0,
        exists: Optional[Iterable[str]] = None,
        boundaries: Optional[Sequence[int]] = None,
    ) -> SavePlan:
        """``boundaries`` (§8, from ``hit_boundaries``): window groups keep only their tails."""
    def hit_boundaries(
        self, num_prompt_tokens: int, *, retention_interval: Optional[int], seen: Optional[Sequence[bool]] = None
    ) -> Optional[List[int]]:
        """§8: the boundaries a later lookup can hit a prompt at (None: every one, dense)."""
    def boundary_hashes(self, block_hashes: Sequence[bytes], num_tokens: int) -> List[bytes]:
        """§8: the hash naming each boundary ``a, 2a, ...`` up to ``num_tokens``."""
    def plan_tail(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        handoffs: Sequence[tuple[int, int, int]],
        *,
        saved_offset: int = 0,
        exists: Optional[Iterable[str]] = None,
    ) -> TailPlan: ...
    def lookup_keys(self, block_hashes: Sequence[bytes], num_tokens: int) -> list[str]:
        """Every key the hit test may consult, in every TP namespace some rank loads."""
    def longest_hit(
        self, block_hashes: Sequence[bytes], num_tokens: int, present: Iterable[str]
    ) -> int: ...
    def longest_hit_bitmap(
        self, block_hashes: Sequence[bytes], num_tokens: int, bitmap: Sequence[bool]
    ) -> int:
        """``longest_hit`` with ``bitmap[i]`` = whether ``lookup_keys(...)[i]`` exists."""
    def plan_load(
        self,
        block_hashes: Sequence[bytes],
        block_ids: Sequence[Sequence[int]],
        hit_tokens: int,
        *,
        local_tokens: int = 0,
    ) -> LoadPlan: ...
    def hit_set_blocks(self, hit_tokens: int) -> List[int]:
        """Per group, how many values a load of a hit of ``hit_tokens`` reads with nothing
        local (the hit's boundary set; 0 where the group takes no part)."""
    def saved_offset_after_load(self, hit_tokens: int) -> int:
        """A request's saved offset once a load of ``hit_tokens`` completed:
        ``hit_tokens // S * S`` (its saves start there)."""

def dedup_gets(gets: Sequence[tuple[str, int, int]]) -> tuple[list[str], list[list[int]]]:
    """Unique keys in first-seen order, and for each the indices of ``gets`` it feeds."""

def xxh3_64_parts(parts: object) -> int:
    """XXH3-64 (seed 0) of one value's parts concatenated (a list/tuple of C-contiguous numpy
    arrays or buffer objects, or one of them): equal to ``xxhash.xxh3_64_intdigest(b"".join(parts))``.
    Hashed with the GIL released (the store payload hash, ``kvstride.stores``)."""

def xxh3_64_batch(values: Sequence[object]) -> list[int]:
    """``xxh3_64_parts`` of each value, GIL released, spread over threads from 1 MiB in all."""

def _save_rows(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, row_start: np.ndarray) -> np.ndarray:
    """Copy each row's regions (uint64 address arrays; row r is regions row_start[r]..row_start[r+1])
    and return the XXH3-64 of each row's bytes in order; GIL released. Raw, unchecked memory
    access: only for kvstride's own copies (``kvstride.arena``, ``kvstride.transfer``)."""

def _load_rows(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, row_start: np.ndarray,
               expected: np.ndarray) -> np.ndarray:
    """Copy each row only when the XXH3-64 of its source bytes is ``expected``; which rows were."""

def _copy_regions(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]``, GIL released, no torch
    thread pool (``kvstride.transfer`` on CPU)."""

def _xxh3_64_regions(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """XXH3-64 of each raw region, GIL released (``kvstride.arena``)."""


class StoreSecret:
    """The value MAC of a deployment secret (>= 32 bytes)."""
    def __init__(self, secret: bytes) -> None: ...
    def payload_tags(self, values: Sequence[Sequence[Any]]) -> list[int]:
        """u64_le(BLAKE3_keyed(k_payload, payload)[:8]) of each value (a list of parts)."""
    def header_macs(self, keys: Sequence[str], lengths: Sequence[int], tags: Sequence[int]) -> list[bytes]:
        """BLAKE3_keyed(k_mac, u32_le(len(key)) || key || u64_le(length) || u64_le(tag))[:16]."""

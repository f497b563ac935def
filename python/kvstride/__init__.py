"""kvstride: exact key and boundary arithmetic for offloading hybrid-model KV caches.

The arithmetic (hashes, geometry, keys, save / tail / lookup / load plans) lives in the Rust
extension ``kvstride._core``; ``kvstride._educational`` is its slow, readable Python twin.
"""

from kvstride._core import (
    GROUP_KINDS,
    HASH_ALGOS,
    BlockHasher,
    GroupSpec,
    KeyPlanner,
    LoadPlan,
    Namespace,
    StoreSecret,
    SavePlan,
    TailPlan,
    cbor_encode,
    dedup_gets,
    hashes_per_block,
    layout_fingerprint,
    resolve_block_sizes,
    stride_keys,
)

__all__ = [
    "GROUP_KINDS",
    "HASH_ALGOS",
    "BlockHasher",
    "GroupSpec",
    "KeyPlanner",
    "LoadPlan",
    "Namespace",
    "StoreSecret",
    "SavePlan",
    "TailPlan",
    "cbor_encode",
    "dedup_gets",
    "hashes_per_block",
    "layout_fingerprint",
    "resolve_block_sizes",
    "stride_keys",
]

__version__ = "0.1.0"

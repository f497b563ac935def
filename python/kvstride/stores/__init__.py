"""Block stores: one protocol, an embedded host-memory arena and the real Mooncake store.

Protocol (both stores)::

    exists(keys) -> list[bool]                      one call, one round trip
    put(keys, buffers) -> list[Status]              idempotent: a present key is left as is
    get(keys, buffers) -> list[Status]              a key asked twice is fetched once and
                                                    written to every destination
    register_buffer(ptr, nbytes); close()

``buffers[i]`` is key i's payload as a list of parts: contiguous CPU torch tensors, numpy arrays,
writable buffers, or ``(address, nbytes)`` pairs (what ``StagedBatch.parts`` gives) that lie
inside memory registered with this store (``register_buffer``, which ``StagingPool.register``
calls). A raw pair anywhere else refuses the whole call (every key ``INVALID``): a store never
reads or writes memory it was not handed.

The embedded store keeps each value in a fixed-size slot of one preallocated arena, with its
XXH3-64 next to it; bound to a KV layout it also copies blocks straight between the KV tensors
and its slots (``save_blocks`` / ``load_blocks``), which is what ``OffloadEngine`` uses. A
Mooncake value is a 64-byte header followed by the parts' bytes in order: a format version,
the layout fingerprint, a digest of the key, the payload length and the payload's XXH3-64.
``put`` / ``get(..., header_room=True)`` (``KVStore.takes_header_room``): each value's first
part starts with 64 bytes of room where the header is written and read, so it moves inside
that part instead of one of its own (the engine stages values so on CPU); same stored bytes.

With a deployment secret (``MooncakeStore(..., secret=)``) the header is version 3: the
digest field holds a keyed payload tag (an AEGIS-128X2 MAC of the payload) and the last 16
bytes a keyed MAC over key, length and tag, so a value written without the secret is
``CORRUPT``, removed and counted (``counters["mac_rejected"]``), never loaded.

Verified reads (``verify=True``, the default): a value whose digest (or header) does not match
is reported ``Status.CORRUPT`` and removed from the store. For ``get`` the bytes of a non-OK
key in its destination buffers are undefined: destinations must be staging buffers, and only
OK keys may be scattered into KV blocks (``Transfer.scatter(batch, ok=[s is Status.OK for s
in statuses])``).

At run time nothing raises: every failure is a status, counted in ``store.counters`` and
logged once per (operation, status).  Construction errors (bad configuration, an unreachable
master) raise ``ValueError`` / ``RuntimeError``.

Modules: :mod:`.base` (the protocol, buffer parts, the value header), :mod:`.placement` (where
the vLLM connector's scheduler puts a step's keys in a store), :mod:`.embedded`,
:mod:`.mooncake` and :mod:`.mooncake_master` (process supervision).
"""

from kvstride.stores.base import FORMAT_VERSION, FORMAT_VERSION_MAC, HEADER_BYTES, KVStore, Status
from kvstride.stores.embedded import EmbeddedStore
from kvstride.stores.mooncake import MooncakeStore
from kvstride.stores.mooncake_master import MasterProcess, start_master

__all__ = [
    "Status",
    "KVStore",
    "EmbeddedStore",
    "MooncakeStore",
    "MasterProcess",
    "start_master",
    "HEADER_BYTES",
    "FORMAT_VERSION",
    "FORMAT_VERSION_MAC",
]

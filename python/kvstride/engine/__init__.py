"""The request-level offload engine: lookups, saves, partial tails and loads, executed through
the data plane on background lanes (loads, saves, and a third that launches device copies).

It knows nothing about vLLM's classes. A driver (the vLLM connector, or ``kvstride simulate``)
calls, per engine step:

- ``lookup(requests)`` on the scheduler side: one existence call for the whole batch of new
  requests, then each request's longest joint hit from the core;
- ``submit(saves, loads)``: one step's work. Saves are planned with the core (which keys,
  which blocks) and copied out of the KV cache before it returns: straight into the embedded
  arena's slots (the whole save), or through the staging pool batch by batch, each batch handed
  to the save lane as soon as it is copied (which puts every batch queued, and those arriving
  within ``put_linger_s``, in one store call); loads run on the load lane, never behind a save;
- or, where planning and execution live in different processes (the vLLM connector: its
  scheduler plans with ``plan_saves`` and the core, its workers execute), ``submit_planned(puts,
  gets)``: the same copies and store calls for ``(key, group, block_id)`` entries planned
  elsewhere, each save job's outcome reported back instead of moving an offset here. With
  ``fenced_groups`` (groups whose blocks the driver writes again only after ``fence(block_ids)``)
  and a store whose copies run on device streams, those groups' copies are launched by the
  launch lane after an event of the caller's stream, so the caller's thread only records the
  event; a fence on blocks whose copies are not launched yet cancels them (they fail);
- ``get_finished()``: which loads and saves completed, and the block ids whose load failed
  (the driver recomputes them); a load not done within ``load_timeout_s`` of its submit is
  reported failed there, and nothing it gets later reaches a KV block.

Nothing raises into the driver's step at run time: store failures, divergent boundaries and
bugs inside a job become outcomes, counted and logged once. A request's saved offset advances
only after every put of its save succeeded; a load whose bytes might be wrong is never
scattered into a KV block.

Staging (any store but the embedded arena): a step's saves stream through the pool's save
share. While the share is full the step waits for staged batches (its own or earlier steps')
to be put, as long as the store keeps up: the save lane's running put began less than
``save_wait_s`` ago. A store that keeps up costs the step a short wait; deferring instead
would lose what a later step cannot plan again, window-group blocks that left vLLM's window and
partial-tail hand-offs, and with them a hit boundary the other groups reach. A stalled store
(one put longer than ``save_wait_s``) does not stall vLLM's step: the rest of the step is
deferred, not failed: counted (``saves_deferred``), its requests' planned offsets go back, and
their next step plans those blocks again. Puts a later step may not plan again are staged
first; a tail deferred all the same is lost (``tails_dropped``). Loads stage in the pool's load
share, which saves never take.

The modules, by role: ``offload`` (:class:`OffloadEngine`: submit, fences, the lanes, outcomes and
request offsets), ``lookups``, ``planning`` (a step's save plans), ``direct`` (saves into a store
that copies blocks itself, and the launch lane), ``staged`` (saves through the staging pool and
the save lane's store calls), ``loads`` (the load lane and its deadline), ``jobs`` (what a driver
hands in and gets back, and the lanes' jobs) and ``settings``. The roles are classes the engine
inherits (mixins): each reads the engine's state, which ``offload`` sets up.
"""

from kvstride.engine.jobs import Finished, LoadRequest, SaveRequest
from kvstride.engine.offload import OffloadEngine
from kvstride.engine.settings import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_PUT_LINGER_S,
    DEFAULT_SAVE_WAIT_S,
    DEFAULT_STAGING_WAIT_S,
    LINGER_MAX_STEPS,
    PUT_KEYS_PER_CALL,
    check_load_timeout,
    check_lookup_timeout,
    check_put_linger,
    check_save_wait,
    check_staging_wait,
)

__all__ = [
    "SaveRequest", "LoadRequest", "Finished", "OffloadEngine",
    "DEFAULT_LOAD_TIMEOUT_S", "DEFAULT_LOOKUP_TIMEOUT_S", "DEFAULT_PUT_LINGER_S", "DEFAULT_SAVE_WAIT_S",
    "DEFAULT_STAGING_WAIT_S", "LINGER_MAX_STEPS", "PUT_KEYS_PER_CALL",
    "check_load_timeout", "check_lookup_timeout", "check_put_linger", "check_save_wait", "check_staging_wait",
]

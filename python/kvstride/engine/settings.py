"""The engine's settings: defaults, the checks of the seconds a driver passes, and the save
lane's batching constants."""

from __future__ import annotations

#: Durations kept per operation for percentiles.
TIMINGS_KEPT = 10_000


#: How long a lookup waits for the store's existence answer before its requests miss (vLLM's
#: scheduler waits for it): a store that hangs costs one lookup this, then every lookup misses
#: at once until the store has answered.
DEFAULT_LOOKUP_TIMEOUT_S = 1.0


#: How long a load may take from its submit until it is reported failed (its request recomputes):
#: a store that hangs costs each request at most this. A 2 GiB load over 1 GB/s TCP takes 2 s.
DEFAULT_LOAD_TIMEOUT_S = 10.0


#: How long a save lane's put may run before the store counts as stalled: a step that finds the
#: staging pool full waits for room while the running put is younger, and defers after.
DEFAULT_SAVE_WAIT_S = 2.0


#: How long one step may wait in all for staging room while the store keeps up (a slow but
#: alive store): past it the step's remaining saves are deferred, as with a stalled store.
DEFAULT_STAGING_WAIT_S = 4.0


#: At most this many keys in one store call of the save lane (``OffloadEngine._next_items``).
PUT_KEYS_PER_CALL = 1024


#: How long the save lane waits for more puts before a store call (``OffloadEngine._next_items``).
#: Mooncake's client (PyPI's build) waits for a put by busy-polling on the calling thread, which
#: then takes a core from vLLM for the whole call: at 0.2 s Gemma-3's bench engine made 44 calls
#: a rep (16 steps each) where 0.05 s made 115-149, and its save lane spent 0.21-0.25 s of CPU
#: a rep, not 0.30-0.42 (BENCHMARKS). A step without saves and ``wait_idle`` end the linger.
DEFAULT_PUT_LINGER_S = 0.2


#: The save lane lingers only while this share of the pool's save share is free.
LINGER_ROOM_SHARE = 0.25


#: ... and for at most this many steps: far fewer than the scheduler waits for a save job's report
#: (``kvstride.vllm.scheduler.ABANDON_AFTER_STEPS``, 64) on an engine whose steps are short.
LINGER_MAX_STEPS = 16


#: How often a waiter for staging room checks whether the running put has stalled.
_ROOM_CHECK_S = 0.05


def _check_seconds(name: str, value, meaning: str, positive: bool = False) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    low_ok = seconds > 0 if positive else seconds >= 0
    if isinstance(value, bool) or not low_ok or seconds == float("inf"):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound} ({meaning}), got {value!r}")
    return seconds


def check_save_wait(value) -> float:
    """``save_wait_s`` as seconds, or ``ValueError`` naming it."""
    return _check_seconds("save_wait_s", value, "how long a store put may run before a step full of saves defers "
                          "instead of waiting")


def check_staging_wait(value) -> float:
    """``staging_wait_s`` as seconds, or ``ValueError`` naming it."""
    return _check_seconds("staging_wait_s", value, "how long one step may wait in all for staging room before "
                          "its remaining saves are deferred")


def check_load_timeout(value) -> float:
    """``load_timeout_s`` as seconds > 0, or ``ValueError`` naming it."""
    return _check_seconds("load_timeout_s", value, "how long a load may take before its request recomputes",
                          positive=True)


def check_lookup_timeout(value) -> float:
    """``lookup_timeout_s`` as seconds > 0, or ``ValueError`` naming it."""
    return _check_seconds("lookup_timeout_s", value, "how long a lookup waits for the store before its requests "
                          "miss", positive=True)


def check_put_linger(value) -> float:
    """``put_linger_s`` as seconds, or ``ValueError`` naming it."""
    return _check_seconds("put_linger_s", value, "how long the save lane waits for more puts to make one store "
                          "call of them; 0: it puts what is queued at once")

"""The scheduler side's lookups: one existence call for a batch of requests, each request's longest
joint hit from the core, and the give-up on a store that does not answer.

A part of :class:`kvstride.engine.OffloadEngine`, which it is mixed into: the state it
reads and the helpers it calls are the engine's (``kvstride/engine/offload.py``)."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Dict, List, Optional, Sequence, Tuple


class Lookups:
    """The scheduler side's lookups."""

    def lookup(self, requests: Sequence[Tuple[str, Sequence[bytes], int]],
               bitmaps: Optional[Dict[str, List[bool]]] = None) -> Dict[str, int]:
        """Longest joint hit per request, from one existence call for the whole batch. After
        ``shutdown`` every request misses and the store is not called. ``bitmaps``, if given,
        gets each request's existence bitmap over ``planner.lookup_keys`` when the store
        answered (none for a request whose answer timed out or failed: its misses are not the
        store's word). A request given as ``(req_id, hashes, num_tokens, planner)`` is keyed by
        its own planner (one bound to its adapter or multimodal content)."""
        with self._lock:
            if self._closed:
                self.count("lookups_refused", len(requests))
                return {request[0]: 0 for request in requests}
            self._lookups_in_flight += 1
        try:
            return self._lookup(requests, bitmaps)
        finally:
            with self._lock:
                self._lookups_in_flight -= 1
                self._idle.notify_all()

    def _lookup(self, requests, bitmaps_out: Optional[Dict[str, List[bool]]]) -> Dict[str, int]:
        start = time.perf_counter()
        per_request = []
        unique: Dict[str, int] = {}
        for req_id, hashes, num_tokens, *own in requests:
            planner = own[0] if own else self.planner
            try:
                keys = planner.lookup_keys(hashes, num_tokens)
            except Exception as err:  # a malformed request misses; the others go on
                self._log_once("lookup-request", "lookup of request %s refused: %r", req_id, err)
                self.count("lookup_errors")
                keys = None
            per_request.append((req_id, hashes, num_tokens, keys, planner))
            for key in keys or ():
                unique.setdefault(key, len(unique))
        present = [False] * len(unique)
        answered = True
        if unique:
            try:
                answer = self._exists_in_time(list(unique))
                answered = answer is not None
                if answered:
                    present = [bool(p) for p in answer]
                    if len(present) != len(unique):
                        raise RuntimeError(f"exists answered {len(present)} of {len(unique)} keys")
            except Exception as err:  # the store's own failures are statuses; this is a bug
                self._log_once("lookup", "lookup failed, treating every request as a miss: %r", err)
                self.count("lookup_errors")
                present, answered = [False] * len(unique), False
        hits = {}
        for req_id, hashes, num_tokens, keys, planner in per_request:
            if keys is None:
                hits[req_id] = 0
                continue
            bitmap = [present[unique[k]] for k in keys]
            hits[req_id] = planner.longest_hit_bitmap(hashes, num_tokens, bitmap)
            if bitmaps_out is not None and answered:
                bitmaps_out[req_id] = bitmap
        with self._lock:
            self.counters["lookups"] += len(per_request)
            self.counters["lookup_hit_tokens"] += sum(hits.values())
            self.counters["lookup_tokens"] += sum(request[2] for request in per_request)
        self.count("lookup_keys", len(unique))
        self._time("lookup", time.perf_counter() - start)
        return hits

    def _exists_in_time(self, keys: List[str]) -> Optional[list]:
        """The store's existence answer for ``keys``, or None when it does not answer within
        ``lookup_timeout_s`` or still has not answered an earlier call (counted in
        ``lookup_timeouts``). A store whose index is here (``knows_contents``) answers at once."""
        if getattr(self.store, "knows_contents", False):
            return self.store.exists(keys)
        with self._lock:
            if self._asked is not None and not self._asked.done():
                self.count("lookup_timeouts")
                return None
            if self._asking is None:
                self._asking = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-lookup")
            self._asked = asked = self._asking.submit(self.store.exists, keys)
        try:
            return asked.result(timeout=self.lookup_timeout_s)
        except concurrent.futures.TimeoutError:
            self.count("lookup_timeouts")
            self._log_once("lookup-timeout", "the store did not answer a lookup within lookup_timeout_s=%gs: "
                           "requests miss until it answers", self.lookup_timeout_s)
            return None

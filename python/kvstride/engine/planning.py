"""Planning a step's saves with the core: the normal save and the partial tail from each request's
planned offset, minus what the store has, in the order a deferral loses least.

A part of :class:`kvstride.engine.OffloadEngine`, which it is mixed into: the state it
reads and the helpers it calls are the engine's (``kvstride/engine/offload.py``)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from kvstride.engine.jobs import SaveRequest, _RequestState


class SavePlanning:
    """Planning a step's saves with the core."""

    def plan_saves(self, saves: Sequence[SaveRequest], states: Sequence["_RequestState"], known, planner=None,
                   depths: Optional[Dict[str, int]] = None, tail_keys: Optional[set] = None):
        """The core's plans for ``saves`` (normal save and partial tail) from each request's
        planned offset, minus keys ``known(keys)`` says are stored; advances the planned offsets.
        ``planner``: another rank's planner (the same groups and offsets, its own keys).
        Returns (entries [(key, group, block_id)], owners {key: [req ids]}, ends, failed req ids).
        Entries a later step may not be able to plan again come first: keys only a partial tail
        names (its hand-off blocks are valid in this step only), then window-group blocks.
        ``depths``, if given, gets each key's depth: the tokens its block ends at (a tail's
        boundary), for an eviction order that keeps prefixes. ``tail_keys``, if given, gets the
        keys only a partial tail names (lost if their save is deferred)."""

        planner = planner or self.planner
        windowed = [spec.kind in ("sliding_window", "chunked_local") for spec in planner.groups]
        ordered: List[Tuple[int, str, int, int]] = []  # (staging order, key, group, block_id)
        owners: Dict[str, List[str]] = {}
        ends: List[int] = []
        failed: set = set()
        tails: set = set()
        for save, state in zip(saves, states):
            with self._lock:
                offset = state.planned
            plan = planner.plan_save(
                save.block_hashes, save.block_ids, save.num_tokens, saved_offset=offset, boundaries=save.boundaries
            )
            ends.append(plan.end)
            puts = list(plan.puts)
            if depths is not None:
                self._depths(planner, save, offset, plan.end, puts, depths)
            if save.handoffs:
                tail = planner.plan_tail(save.block_hashes, save.block_ids, save.handoffs, saved_offset=offset)
                self.count(f"tail_{tail.outcome}")
                if tail.outcome == "divergent_boundaries":
                    self._log_once(
                        "divergent",
                        "partial-tail hand-offs of request %s disagree on the boundary; its tail "
                        "is not stored (the normal save goes on)",
                        save.req_id,
                    )
                # Keys only the tail names (hand-off states, a partial boundary block): the
                # next step cannot plan them again.
                normal = {key for key, _, _ in puts}
                tails.update(key for key, _, _ in tail.puts if key not in normal)
                puts.extend(tail.puts)
                if depths is not None and tail.boundary is not None:
                    depths.update((key, int(tail.boundary)) for key, _, _ in tail.puts)
            req_id = save.req_id
            for (key, group, block_id), inside in zip(puts, self._entries_in_layout(puts)):
                if not inside:
                    self._bad_save_block(f"request {req_id}", (key, group, block_id))
                    failed.add(req_id)
                    continue
                waiting = owners.get(key)
                if waiting is None:
                    owners[key] = [req_id]
                    order = 0 if key in tails else 1 if windowed[group] else 2
                    ordered.append((order, key, group, block_id))
                elif req_id not in waiting:
                    waiting.append(req_id)
        with self._lock:
            for save, state, end in zip(saves, states, ends):
                if save.req_id not in failed:
                    state.planned = max(state.planned, end)
        ordered.sort(key=lambda entry: entry[0])  # stable: group and block order within each
        entries = [(key, group, block_id) for _, key, group, block_id in ordered]
        if entries:
            present = [bool(p) for p in known([key for key, _, _ in entries])]
            if len(present) != len(entries):  # a short answer: put everything (puts are idempotent)
                present = [False] * len(entries)
            self.count("put_skipped_present", sum(present))
            entries = [e for e, p in zip(entries, present) if not p]
        if tail_keys is not None:
            tail_keys |= tails
        return entries, owners, ends, failed

    @staticmethod
    def _depths(planner, save: SaveRequest, offset: int, end: int, puts, depths: Dict[str, int]) -> None:
        """Each put's block end in tokens, from the block-table rows the save covered (the
        normal save writes blocks in [offset, end) only: the cost stays that of the step)."""
        rows: Dict[int, Dict[int, int]] = {}
        for key, group, block_id in puts:
            b = planner.groups[group].block_size
            where = rows.get(group)
            if where is None:
                lo = offset // b
                table = save.block_ids[group]
                where = rows[group] = {bid: i for i, bid in enumerate(table[lo : -(-end // b)], lo)}
            row = where.get(block_id)
            depths[key] = end if row is None else (row + 1) * b

    def _starts(self, states) -> List[int]:
        with self._lock:
            return [state.planned for state in states]

    def request_states(self, req_ids: Sequence[str]) -> List["_RequestState"]:
        with self._lock:
            return [self._requests.setdefault(rid, _RequestState()) for rid in req_ids]

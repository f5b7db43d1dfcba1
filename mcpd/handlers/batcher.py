"""The dynamic batcher of a handler's worker, as Triton's: requests wait a moment so that several
go to `predict` together, and a batch goes out as soon as waiting longer cannot make it better.

A batch goes out when its rows reach max_batch_size, or reach a preferred size (the largest the
waiting requests reach), or cannot grow (the next request would not fit), else when its oldest
request has waited max_queue_delay_ms. Requests wait in priority order (the scheduler's rank:
higher goes first, then the older), and a group led by a request of `urgent_rank` or above goes
without waiting for the delay (the worker passes the ranks above the default class: an important
request is not held for others to join it). A request's rows are never split, one with more rows than
max_batch_size runs alone, and max_batch_size 0 runs every request alone at once. Requests whose
variable dim falls in different length bins never share a batch, so a short one is not padded to
a long one's length (past the largest bin, all are one group), unless the padding costs less
than the predict of their own that sharing saves.

Once the worker has measured its predicts (predict_cost.py) and the requests' arrival rate, the
delay is only an upper bound: a batch waits while the rows expected to arrive within one
predict's fixed cost outnumber those already waiting (a later batch of their own would cost the
device more than the wait costs them), and goes at once otherwise. The settings are checked
where they are read (config/handlers.py). Socket-free: the caller passes `now`.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from mcpd.handlers.predict_cost import PredictCost

ARRIVAL_MEMORY = 32   # about how many recent arrivals the arrival rate weighs


@dataclass
class Pending:
    """A request waiting for its batch: `length` is its variable dim's size (0: none), `rank` the
    scheduler's effective rank (higher goes first), `item` the caller's."""
    key: int
    rows: int
    length: int
    rank: int
    arrived: float
    item: object


def padded_elements(batch: list[Pending]) -> int:
    """A batch's size as predict pays for it: its rows, each padded to the longest."""
    return sum(p.rows for p in batch) * max(1, max(p.length for p in batch))


class DynamicBatcher:
    def __init__(self, max_batch_size: int, max_queue_delay_ms: float, preferred_batch_sizes=(),
                 length_bins=(), urgent_rank: float = float("inf"), cost: PredictCost | None = None):
        self.max_batch_size = max_batch_size
        self.delay = max_queue_delay_ms / 1000.0
        self.urgent_rank = urgent_rank
        self.preferred = frozenset(preferred_batch_sizes)
        self.length_bins = sorted(set(length_bins))
        self._groups: dict[int, list[tuple[tuple, Pending]]] = {}   # bin -> waiting, in the order they go
        self._where: dict[int, tuple[int, tuple]] = {}              # key -> (bin, its order)
        self._seq = itertools.count()
        self.cost = cost if cost is not None else PredictCost()
        self._last_arrival: float | None = None
        self._gap_s: float | None = None   # the mean time between arrivals, recent ones weighing more

    def __len__(self) -> int:
        return len(self._where)

    def add(self, pending: Pending) -> None:
        if pending.key in self._where:
            raise ValueError(f"request {pending.key} is already waiting")
        order = (-pending.rank, pending.arrived, next(self._seq))
        group = self._bin_of(pending.length)
        bisect.insort(self._groups.setdefault(group, []), (order, pending), key=lambda entry: entry[0])
        self._where[pending.key] = (group, order)
        self._note_arrival(pending.arrived)

    def _note_arrival(self, arrived: float) -> None:
        if self._last_arrival is not None:
            gap = max(0.0, arrived - self._last_arrival)
            self._gap_s = gap if self._gap_s is None else self._gap_s + (gap - self._gap_s) / ARRIVAL_MEMORY
        self._last_arrival = arrived

    def remove(self, key: int) -> Pending | None:
        """Take a waiting request out (it was cancelled); None if it is not waiting."""
        where = self._where.pop(key, None)
        if where is None:
            return None
        group, order = where
        waiting = self._groups[group]
        at = bisect.bisect_left(waiting, order, key=lambda entry: entry[0])
        pending = waiting.pop(at)[1]
        if not waiting:
            del self._groups[group]
        return pending

    def next_batch(self, now: float, full_only: bool = False) -> list[Pending] | None:
        """The batch that goes now (taken out of the waiting), or None: nothing is ready. With
        `full_only`, only when that batch holds max_batch_size rows (or more, a request alone):
        the worker queues it behind a running predict, where a smaller one would gather more."""
        best = None   # (its head's order, group, count): the ready group whose head goes first
        for group, waiting in self._groups.items():
            count = self._ready_count(waiting, now)
            if count and (best is None or waiting[0][0] < best[0]):
                best = (waiting[0][0], group, count)
        if best is None:
            return None
        _, group, count = best
        if full_only and not self._is_full(self._groups[group][:count]):
            return None
        batch = self._take(group, count)
        if self.max_batch_size:
            batch += self._joining(batch)
        return batch

    def _is_full(self, entries: list[tuple[tuple, Pending]]) -> bool:
        return self.max_batch_size > 0 and sum(pending.rows for _, pending in entries) >= self.max_batch_size

    def _take(self, group: int, count: int) -> list[Pending]:
        waiting = self._groups[group]
        batch = [pending for _, pending in waiting[:count]]
        del waiting[:count]
        if not waiting:
            del self._groups[group]
        for pending in batch:
            del self._where[pending.key]
        return batch

    def _joining(self, batch: list[Pending]) -> list[Pending]:
        """Whole groups of other length bins, in the order their heads go, that fit the batch's
        rows and whose padding costs less than the predict of their own it saves."""
        if not self.cost.known:
            return []
        joined = []
        for group in sorted(self._groups, key=lambda g: self._groups[g][0][0]):
            room = self.max_batch_size - sum(p.rows for p in batch + joined)
            if len(self._groups[group]) > room:   # a request has a row at least: it cannot fit
                continue
            waiting = [pending for _, pending in self._groups[group]]
            together = batch + joined + waiting
            if sum(p.rows for p in waiting) > room:
                continue
            padding = padded_elements(together) - padded_elements(batch + joined) - padded_elements(waiting)
            if self.cost.padding_pays(padding):
                joined += self._take(group, len(waiting))
        return joined

    def due(self) -> float | None:
        """When the oldest waiting request's delay runs out (a batch is ready by then; an urgent
        request's, when it arrived); None: none waits."""
        if not self._where:
            return None
        return min(map(self._group_due, self._groups.values()))

    def _group_due(self, waiting: list[tuple[tuple, Pending]]) -> float:
        rows = sum(pending.rows for _, pending in waiting[:max(1, self.max_batch_size)])   # a full batch's at most
        held = self.delay if self._waiting_pays(rows) else 0.0
        return min(pending.arrived + (0.0 if pending.rank >= self.urgent_rank else held) for _, pending in waiting)

    def _bin_of(self, length: int) -> int:
        """The smallest bin that holds `length`; past the largest bin, one group for all the longer."""
        if not self.length_bins:
            return 0
        at = bisect.bisect_left(self.length_bins, length)
        return self.length_bins[at] if at < len(self.length_bins) else -1

    def _ready_count(self, waiting: list[tuple[tuple, Pending]], now: float) -> int:
        """How many of a group's first requests go now (0: the group waits)."""
        if self.max_batch_size == 0 or waiting[0][1].rows >= self.max_batch_size:
            return 1
        rows, count, preferred, grows = 0, 0, 0, True
        for _, pending in waiting:
            if rows + pending.rows > self.max_batch_size:
                grows = False
                break
            rows += pending.rows
            count += 1
            if rows in self.preferred:
                preferred = count
        if rows == self.max_batch_size:
            return count
        if preferred:
            return preferred
        if not grows or waiting[0][1].rank >= self.urgent_rank:
            return count   # the next request does not fit, or the head may not wait for others
        oldest = min(pending.arrived for _, pending in waiting)
        return count if now >= oldest + self.delay or not self._waiting_pays(rows) else 0

    def _waiting_pays(self, rows: int) -> bool:
        """Whether a group of `rows` should wait for more: while the rows expected within one
        predict's fixed cost outnumber its own (unmeasured: the configured delay decides)."""
        if not self.cost.known or self._gap_s is None:
            return True
        return self.cost.fixed_s >= rows * self._gap_s

"""The dynamic batcher of a handler's worker, as Triton's: requests wait a moment so that several
go to `predict` together, and a batch goes out as soon as waiting longer cannot make it better.

A batch goes out when its rows reach max_batch_size, or reach a preferred size (the largest the
waiting requests reach), or cannot grow (the next request would not fit), else when its oldest
request has waited max_queue_delay_ms. Requests wait in priority order (the scheduler's rank:
higher goes first, then the older), a request's rows are never split, one with more rows than
max_batch_size runs alone, and max_batch_size 0 runs every request alone at once. Requests whose
variable dim falls in different length bins never share a batch, so a short one is not padded to
a long one's length. Socket-free: the caller passes `now`.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np

from mcpd.handlers.tensors import VARIABLE, TensorSpec


@dataclass
class Pending:
    """A request waiting for its batch. `length` is its variable dim's size (0: none); `item` is
    its preprocessed inputs, name -> array, each with its rows on dim 0."""
    key: int
    rows: int
    length: int
    rank: int
    arrived: float
    item: object


class DynamicBatcher:
    def __init__(self, max_batch_size: int, max_queue_delay_ms: float, preferred_batch_sizes=(),
                 length_bins=()):
        if max_batch_size < 0 or max_queue_delay_ms < 0:
            raise ValueError("max_batch_size and max_queue_delay_ms are 0 or more")
        if any(not 0 < size <= max_batch_size for size in preferred_batch_sizes):
            raise ValueError(f"preferred_batch_sizes are 1..max_batch_size ({max_batch_size})")
        if any(b <= 0 for b in length_bins):
            raise ValueError("length_bins are positive")
        self.max_batch_size = max_batch_size
        self.delay = max_queue_delay_ms / 1000.0
        self.preferred = frozenset(preferred_batch_sizes)
        self.length_bins = sorted(set(length_bins))
        self._groups: dict[int, list[tuple[tuple, Pending]]] = {}   # bin -> waiting, in the order they go
        self._where: dict[int, tuple[int, tuple]] = {}              # key -> (bin, its order)
        self._seq = itertools.count()
        self._padded = 0
        self._positions = 0

    def __len__(self) -> int:
        return len(self._where)

    def add(self, pending: Pending) -> None:
        if pending.key in self._where:
            raise ValueError(f"request {pending.key} is already waiting")
        order = (-pending.rank, pending.arrived, next(self._seq))
        group = self._bin_of(pending.length)
        bisect.insort(self._groups.setdefault(group, []), (order, pending), key=lambda entry: entry[0])
        self._where[pending.key] = (group, order)

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

    def next_batch(self, now: float) -> list[Pending] | None:
        """The batch that goes now (taken out of the waiting), or None: nothing is ready."""
        best = None   # (its head's order, group, count): the ready group whose head goes first
        for group, waiting in self._groups.items():
            count = self._ready_count(waiting, now)
            if count and (best is None or waiting[0][0] < best[0]):
                best = (waiting[0][0], group, count)
        if best is None:
            return None
        _, group, count = best
        waiting = self._groups[group]
        batch = [pending for _, pending in waiting[:count]]
        del waiting[:count]
        if not waiting:
            del self._groups[group]
        for pending in batch:
            del self._where[pending.key]
        self._count_padding(batch)
        return batch

    def due(self) -> float | None:
        """When the oldest waiting request's delay runs out (a batch is ready by then); None: none waits."""
        if not self._where:
            return None
        return min(pending.arrived for waiting in self._groups.values() for _, pending in waiting) + self.delay

    def padding(self) -> float:
        """Of the variable-dim positions in the batches so far, the share that was padding."""
        return self._padded / self._positions if self._positions else 0.0

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
        if not grows:
            return count   # the next request does not fit: waiting longer would not help
        oldest = min(pending.arrived for _, pending in waiting)
        return count if now >= oldest + self.delay else 0

    def _count_padding(self, batch: list[Pending]) -> None:
        longest = max(pending.length for pending in batch)
        self._positions += longest * sum(pending.rows for pending in batch)
        self._padded += sum(pending.rows * (longest - pending.length) for pending in batch)


def length_dim(spec: TensorSpec) -> int | None:
    """The variable dim of an input beside its rows (padded in a batch), or None. A handler may
    declare one: "<name>.lengths" could not describe two."""
    variable = [dim for dim, size in enumerate(spec.shape) if dim and size == VARIABLE]
    if len(variable) > 1:
        raise ValueError(f"shape {list(spec.shape)}: one variable dim beside the rows at most")
    return variable[0] if variable else None


def assemble(batch: list[Pending], specs: dict[str, TensorSpec]) -> dict[str, np.ndarray]:
    """predict's input: each input's requests concatenated on dim 0, a variable dim padded with
    zeros to the batch's longest, and "<name>.lengths" (int64, one per row) beside a padded input."""
    assembled = {}
    for name, spec in specs.items():
        arrays = [pending.item[name] for pending in batch]
        dim = length_dim(spec)
        if dim is None:
            assembled[name] = np.concatenate(arrays)
            continue
        assembled[name] = _padded(arrays, dim)
        assembled[f"{name}.lengths"] = np.concatenate(
            [np.full(len(array), array.shape[dim], np.int64) for array in arrays])
    return assembled


def _padded(arrays: list[np.ndarray], dim: int) -> np.ndarray:
    longest = max(array.shape[dim] for array in arrays)
    shape = list(arrays[0].shape)
    shape[0], shape[dim] = sum(len(array) for array in arrays), longest
    out = np.zeros(shape, arrays[0].dtype)
    if out.dtype == object:
        out.fill(b"")   # BYTES pads with empty elements
    row = 0
    for array in arrays:
        index = [slice(row, row + len(array))] + [slice(None)] * (array.ndim - 1)
        index[dim] = slice(0, array.shape[dim])
        out[tuple(index)] = array
        row += len(array)
    return out


def split(outputs: dict[str, np.ndarray], batch: list[Pending]) -> list[dict[str, np.ndarray]]:
    """Each request's rows of predict's outputs, in the batch's order. Raises ValueError when an
    output's rows are not the batch's rows: that batch's requests fail, no other."""
    rows = sum(pending.rows for pending in batch)
    for name, array in outputs.items():
        if not isinstance(array, np.ndarray) or array.ndim == 0:
            raise ValueError(f"handler returned output {name!r} as {type(array).__name__}, not rows of an array")
        if len(array) != rows:
            raise ValueError(f"handler returned {len(array)} rows for {rows} (output {name!r})")
    parts, start = [], 0
    for pending in batch:
        parts.append({name: array[start:start + pending.rows] for name, array in outputs.items()})
        start += pending.rows
    return parts

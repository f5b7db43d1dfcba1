"""The handler worker's predict thread: batches run on it one after another, in the order they
were submitted, while the worker's loop decodes, preprocesses and answers. Up to DEPTH batches
are in flight, the running one and one queued behind it, so that a full batch formed during a
predict starts the moment that predict ends: a hand-off through the loop would leave the device
idle while the loop notices the end, and longer when another process holds the loop's core.
Each predict's end wakes the loop through `wake_fd`."""
from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mcpd.cpu import threads

DEPTH = 2   # one running, one queued: a deeper queue would fix batches before their rows arrive


@dataclass
class Running:
    """A batch on the predict thread; `started`: its submit, or (queued) when the batch ahead of
    it was seen to end; `elements`: its padded size, for the batcher's cost of a predict (None: a
    request run alone after its batch failed, not a batch the batcher made)."""
    future: Future
    requests: list
    started: float
    elements: int | None = None


class PredictThread:
    def __init__(self, clock):
        self.clock = clock
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="predict", initializer=_on_every_core)
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.in_flight: deque[Running] = deque()

    @property
    def running(self) -> Running | None:
        """The batch whose predict runs now (or has just ended, not yet taken)."""
        return self.in_flight[0] if self.in_flight else None

    @property
    def has_room(self) -> bool:
        return len(self.in_flight) < DEPTH

    def submit(self, predict, batch: dict[str, np.ndarray], requests: list, elements: int | None) -> None:
        future = self.executor.submit(_timed, predict, batch)
        future.add_done_callback(self._wake)
        self.in_flight.append(Running(future, requests, self.clock(), elements))

    def ended(self) -> list[Running]:
        """The batches whose predict ended, in order, taken off the thread. The wake is cleared
        first: an end after that wakes the loop again, one before it is seen here."""
        try:
            os.eventfd_read(self.wake_fd)
        except BlockingIOError:
            pass
        ended = []
        while self.in_flight and self.in_flight[0].future.done():
            ended.append(self.in_flight.popleft())
        if ended and self.in_flight:
            self.in_flight[0].started = self.clock()
        return ended

    def _wake(self, _future: Future) -> None:
        os.eventfd_write(self.wake_fd, 1)

    def shutdown(self, wait: bool = True) -> None:
        self.executor.shutdown(wait)


def _on_every_core() -> None:
    """Let this thread run on any of the worker's cores when torch runs fewer threads than it
    has. OpenMP binds the thread that loads it to the first core (cpu/threads.py), and threads
    started later inherit that: a one-thread predict and the loop that feeds it then queue for
    that one core while another sits idle."""
    import torch   # the worker loaded it before the core

    owned = threads.owned_cores()
    if torch.get_num_threads() < len(owned):
        os.sched_setaffinity(0, owned)


def _timed(predict, batch: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
    """predict's outputs and its seconds, timed on the predict thread: the loop sees the end only
    when it next looks."""
    started = time.perf_counter()
    outputs = predict(batch)
    return outputs, time.perf_counter() - started

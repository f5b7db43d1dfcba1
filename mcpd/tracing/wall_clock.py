"""Monotonic seconds as wall-clock nanoseconds, the same in every process of a daemon.

The offset is drawn once by the supervisor and inherited by its children through the
environment, so spans of different processes (a hop's two ends) line up to the nanosecond;
fixed at start, they never move against each other when the wall clock is stepped."""
from __future__ import annotations

import os
import time

OFFSET_ENV = "MCPD_WALL_OFFSET_NS"


def share_offset() -> None:
    """Draw the offset for the children this process starts (before it starts any)."""
    os.environ[OFFSET_ENV] = str(time.time_ns() - time.monotonic_ns())


def offset_ns() -> int:
    """The offset this process's parent drew, or one of its own (a process on its own)."""
    return int(os.environ.get(OFFSET_ENV) or time.time_ns() - time.monotonic_ns())

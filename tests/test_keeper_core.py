"""The pool keeper's core in-process: Ready at start, the pool's figures every report interval
and not between, and nothing more once the supervisor is gone."""
from __future__ import annotations

import pytest

from mcpd.daemon import messages
from mcpd.daemon.keeper_core import KeeperCore
from mcpd.memory.pool_stats import PoolStats

from fakes import Clock, Events

INTERVAL = 0.5


def free(nbytes: int) -> PoolStats:
    """A 32-byte pool with `nbytes` of it free."""
    return PoolStats(32, 32 - nbytes, 32 - nbytes, nbytes, nbytes, 0.0, 0.0, [])


def keeper(figures: list[PoolStats]) -> tuple[KeeperCore, Events]:
    events = Events("keeper")
    return KeeperCore("cpu", "/run/mcpd/pool-cpu", INTERVAL, events, lambda: figures[-1]), events


def reports(events: Events) -> list[PoolStats]:
    return [event.stats.pool for event in events.sent if isinstance(event, messages.Report)]


def test_start_says_ready_and_nothing_else():
    core, events = keeper([free(1)])
    core.start()
    assert [type(event) for event in events.sent] == [messages.Ready]


def test_the_first_tick_reports_the_pool_at_once_and_names_the_device_and_segment():
    clock, (core, events) = Clock(), keeper([free(7)])
    assert core.tick(clock(), supervisor_alive=True) == INTERVAL
    [report] = [event for event in events.sent if isinstance(event, messages.Report)]
    assert (report.stats.device, report.stats.path, report.stats.pool) == ("cpu", "/run/mcpd/pool-cpu", free(7))


def test_a_tick_before_the_interval_sends_nothing_and_says_how_long_to_wait():
    clock, (core, events) = Clock(), keeper([free(7)])
    core.tick(clock(), supervisor_alive=True)
    clock.now += 0.2
    assert core.tick(clock(), supervisor_alive=True) == pytest.approx(INTERVAL - 0.2)
    assert len(reports(events)) == 1


def test_each_due_report_carries_the_pool_as_it_is_then():
    figures = [free(7)]
    clock, (core, events) = Clock(), keeper(figures)
    core.tick(clock(), supervisor_alive=True)
    figures.append(free(3))
    clock.now += INTERVAL
    core.tick(clock(), supervisor_alive=True)
    assert reports(events) == [free(7), free(3)]


def test_once_the_supervisor_is_gone_the_keeper_stops_without_reporting():
    clock, (core, events) = Clock(), keeper([free(7)])
    core.tick(clock(), supervisor_alive=True)
    clock.now += INTERVAL
    assert core.tick(clock(), supervisor_alive=False) is None
    assert len(reports(events)) == 1

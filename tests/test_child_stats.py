"""The typed stats the supervisor keeps of each child (mcpd/daemon/child_stats.py)."""
import msgspec
import pytest

from mcpd.daemon import child_stats, messages
from mcpd.daemon.child_stats import FrontendStats, KeeperStats, SchedulerStats, WorkerStats
from mcpd.daemon.frontend.outbox import OutboxStats
from mcpd.memory.pool_stats import PoolStats


def test_a_report_decodes_to_its_kinds_stats_and_unknown_figures_are_dropped():
    """A newer child's extra figure, at any depth, must not break an older supervisor."""
    newer = msgspec.msgpack.encode({"type": "frontend", "served": 3, "draining": True, "from_a_newer_child": 1,
                                    "backlog": {"clients": 1, "replies": 2, "bytes": 3, "from_a_newer_child": 4}})
    frames = [messages.Report.TAG, msgspec.msgpack.encode([["frontend", 0, 9], msgspec.Raw(newer)])]
    report, _ = messages.decode(frames)
    assert report.stats == FrontendStats(served=3, draining=True, backlog=OutboxStats(1, 2, 3))
    assert report.sender.pid == 9
    pool = PoolStats(8, 5, 5, 3, 3, 0.0, 0.0, [])
    keeper = KeeperStats(device="cpu", pool=pool)
    assert messages.decode(messages.encode(messages.Report(messages.Sender("keeper", 0, 9), keeper)))[0].stats == keeper
    worker = WorkerStats(running=2, steps=7, kv_blocks_used=0)
    assert worker.reported(("running", "waiting", "kv_blocks_used", "in_use_bytes")) == {"running": 2, "kv_blocks_used": 0}


def test_a_figure_a_child_does_not_declare_fails_in_the_child():
    with pytest.raises(TypeError):
        SchedulerStats(queue_depth=1, undeclared_figure=2)


def test_before_the_first_report_each_kind_is_empty():
    assert child_stats.empty("scheduler") == SchedulerStats() and SchedulerStats().queue_time == {}
    assert WorkerStats().reported(("device", "running")) == {}

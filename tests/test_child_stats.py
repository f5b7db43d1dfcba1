"""The typed stats the supervisor keeps of each child (mcpd/daemon/child_stats.py)."""
from mcpd.daemon import child_stats
from mcpd.daemon.child_stats import FrontendStats, SchedulerStats, WorkerStats


def test_an_event_becomes_its_kinds_stats_and_unknown_figures_are_dropped():
    front = child_stats.of("frontend", {"role": "frontend", "index": 0, "pid": 9, "event": "stats",
                                        "served": 3, "draining": True, "from_a_newer_child": 1})
    assert front == FrontendStats(served=3, draining=True)
    worker = child_stats.of("worker", {"running": 2, "pool": {"in_use_bytes": 5}, "steps": 7})
    assert worker.reported(("running", "waiting", "pool", "in_use_bytes")) == {"running": 2, "pool": {"in_use_bytes": 5}}


def test_before_the_first_report_each_kind_is_empty():
    assert child_stats.empty("scheduler") == SchedulerStats() and SchedulerStats().queue_time is None
    assert WorkerStats().reported(("device", "running")) == {}

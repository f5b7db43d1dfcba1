"""The scheduler's policies on their own (pure classes); its core is tested in test_scheduler_core.py."""

from mcpd.config import PriorityClass
from mcpd.daemon.scheduler.batching_window import ADJUST_EVERY, BatchingWindow
from mcpd.daemon.scheduler.class_queues import ClassQueues
from mcpd.daemon.scheduler.degradation import DegradationLadder
from mcpd.daemon.scheduler.job import Job
from mcpd.daemon.scheduler.token_bucket import TokenBucket

CLASSES = {"high": PriorityClass(rank=2), "mid": PriorityClass(rank=1, max_age_s=10.0),
           "low": PriorityClass(rank=0, max_age_s=10.0)}


def job(rid: int, class_name: str, enqueued: float) -> Job:
    return Job(rid, None, [], class_name=class_name, seq=rid, enqueued=enqueued)


def test_token_bucket_grants_a_burst_then_the_rate():
    bucket = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == 0.5          # one token every 0.5 s
    assert bucket.take(0.5) == 0.0 and bucket.take(0.5) > 0


def test_queues_serve_rank_then_age_and_promote_the_starving():
    queues = ClassQueues(CLASSES, fifo=False)
    for j in (job(1, "low", 0.0), job(2, "mid", 1.0), job(3, "high", 2.0), job(4, "mid", 3.0)):
        queues.push(j)
    assert drain(queues, 5.0) == [3, 2, 4, 1]
    queues.push(job(5, "low", 0.0))
    queues.push(job(6, "mid", 5.0))
    assert queues.peek(now=9.0).rid == 6     # low has waited 9 s of its 10 s age limit
    assert queues.peek(now=11.0).rid == 5    # now it ranks as mid, and it is older
    queues.push(job(7, "high", 11.0))
    assert queues.peek(now=11.0).rid == 7
    assert queues.peek(now=21.0).rid == 5    # two age limits: up two classes, to the top


def drain(queues: ClassQueues, now: float) -> list[int]:
    order = []
    while (head := queues.peek(now)) is not None:
        queues.remove(head)
        order.append(head.rid)
    return order


def test_fifo_policy_is_arrival_order():
    queues = ClassQueues(CLASSES, fifo=True)
    for j in (job(1, "low", 0.0), job(2, "high", 1.0), job(3, "mid", 2.0)):
        queues.push(j)
    assert drain(queues, 3.0) == [1, 2, 3]


def test_window_widens_with_headroom_narrows_over_target_and_stays_in_bounds():
    window = BatchingWindow(target_p99_ms=50, min_ms=0, max_ms=20, smoothing=0.2)
    seen = []
    for _ in range(40 * ADJUST_EVERY):
        window.observe(5.0)
        seen.append(window.window_ms)
    assert 0 <= min(seen) and max(seen) <= 20 and seen[-1] > 15
    assert all(b >= a for a, b in zip(seen, seen[1:]))   # smooth: no oscillation on a steady load
    for _ in range(40 * ADJUST_EVERY):
        window.observe(200.0)
    assert window.window_ms < 1


def test_degradation_ladder_caps_then_sheds_and_recovers():
    ladder = DegradationLadder(queue_depth=10, after_s=1.0)
    low = PriorityClass(degrade_max_tokens=32, shed=True)
    ladder.update(10, now=0.0)
    assert ladder.max_tokens_cap(low, 0.5) is None and not ladder.sheds(low, 0.5)
    assert ladder.max_tokens_cap(low, 1.0) == 32 and not ladder.sheds(low, 1.0)
    assert ladder.sheds(low, 2.0) and ladder.max_tokens_cap(PriorityClass(), 2.0) is None
    ladder.update(6, now=2.1)      # below the threshold but above half: still overloaded
    assert ladder.level(2.1) == 2
    ladder.update(4, now=2.2)
    assert ladder.level(2.2) == 0

"""A full queue never locks a more important class out (issue 13): a critical request displaces
the newest waiting low one, which gets OVERLOADED with retry_after_ms; a low request never
displaces anything. One worker seats one sequence and takes one request per rank, so a running
critical stream holds everything else in the queue: the test arranges the queue by that."""
import pytest

from mcpd.protocol import codes
from mcpd.testing import final_reply

CLASSES = {"critical": {"rank": 3, "max_queue": 8}, "low": {"rank": 0, "max_queue": 8}}


@pytest.fixture(scope="module")
def d(module_daemon):
    return module_daemon(scheduler={"max_inflight_per_worker": 1, "default_class": "low", "max_queue": 4},
                         engine={"max_num_seqs": 1},
                         **{f"scheduler.classes.{name}": keys for name, keys in CLASSES.items()})


def gen(client, prompt: str, priority: str) -> int:
    return client.send("generate", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}, priority=priority)


def test_critical_requests_displace_the_newest_low_ones_and_never_the_reverse(d):
    with d.client() as client:
        blocker = client.send("generate", {"prompt": "block", "max_tokens": 2000, "ignore_eos": True,
                                           "stream": True}, priority="critical")
        assert client.receive(blocker)["kind"] == "chunk"
        lows = [gen(client, f"low {i}", "low") for i in range(4)]
        d.wait_until(lambda: client.status()["queue_depth"] == 4, 30, "the queue full of lows")
        criticals = [gen(client, f"critical {i}", "critical") for i in range(2)]
        displaced = [final_reply(client, rid) for rid in lows[2:]]   # the newest lows made room
        assert all(r["code"] == codes.OVERLOADED and r["retry_after_ms"] > 0 for r in displaced), displaced
        assert all("displaced" in r["message"] for r in displaced)
        refused = final_reply(client, gen(client, "one low too many", "low"))   # a low displaces nobody
        assert refused["code"] == codes.OVERLOADED and "queue is full" in refused["message"]
        criticals += [gen(client, f"critical {i}", "critical") for i in range(2, 4)]
        assert [final_reply(client, rid)["code"] for rid in lows[:2]] == [codes.OVERLOADED] * 2
        refused = final_reply(client, gen(client, "critical 4", "critical"))   # nor a critical its equal
        assert refused["code"] == codes.OVERLOADED and "queue is full" in refused["message"]
        client.cancel(blocker)
        assert final_reply(client, blocker)["code"] == codes.CANCELLED
        assert [final_reply(client, rid)["kind"] for rid in criticals] == ["ok"] * 4


def test_the_displaced_request_is_the_newest_of_the_lowest_effective_rank():
    from mcpd.config import PriorityClass
    from mcpd.daemon.scheduler.class_queues import ClassQueues
    from mcpd.daemon.scheduler.job import Job

    queues = ClassQueues({"high": PriorityClass(rank=2), "mid": PriorityClass(rank=1),
                          "low": PriorityClass(rank=0, max_age_s=10.0)}, fifo=False)
    for rid, name, enqueued in ((1, "low", 0.0), (2, "low", 1.0), (3, "mid", 2.0)):
        queues.push(Job(rid, None, [], class_name=name, seq=rid, enqueued=enqueued))
    assert queues.least_important_below(2, now=5.0).rid == 2    # the newer low
    assert queues.least_important_below(0, now=5.0) is None     # nothing ranks below the lowest
    # After 10.5 s job 1 aged into mid; job 2 (9.5 s) is still low: it goes.
    assert queues.least_important_below(1, now=10.5).rid == 2
    assert queues.least_important_below(1, now=11.5) is None    # both aged to mid: none below mid
    fifo = ClassQueues(queues.classes, fifo=True)   # arrival order: no class outranks another
    fifo.push(Job(4, None, [], class_name="low", seq=4, enqueued=0.0))
    high = Job(5, None, [], class_name="high", seq=5, enqueued=0.0)
    assert fifo.least_important_below(fifo.effective_rank(high, 0.0), now=0.0) is None

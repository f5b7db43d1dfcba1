"""Tenants share a class fairly, in-process: the fair queue's order by weight and tokens, a
flood that leaves a newcomer a worker slot, each tenant's caps, and a full queue that a flood
cannot hold against the others. The daemon end to end: test_noisy_neighbour.py."""
import tempfile

import pytest
from fakes import Clock, Ports, decoded, scheduler_of
from test_scheduler_core import dispatched, from_worker, hello, request

from mcpd.config import ConfigError, PriorityClass, from_dict
from mcpd.daemon import messages
from mcpd.daemon.scheduler.class_queues import ClassQueues
from mcpd.daemon.scheduler.core import Scheduler
from mcpd.daemon.scheduler.job import Job
from mcpd.protocol import codes
from mcpd.protocol.args import GenerateArgs
from mcpd.protocol.sampling import SamplingParams

CLASSES = {"normal": PriorityClass(rank=1, max_age_s=10.0), "high": PriorityClass(rank=2)}


def job(rid: int, tenant: str, cost: int = 100, class_name: str = "normal", enqueued: float = 0.0) -> Job:
    return Job(rid, None, [], class_name=class_name, client=tenant, cost=cost, seq=rid, enqueued=enqueued)


def serve(queues: ClassQueues, count: int, now: float = 1.0) -> list[Job]:
    """Dispatch `count` jobs in the order the queues give them."""
    order = []
    while len(order) < count and (head := queues.peek(now)) is not None:
        queues.served(head)
        order.append(head)
    return order


def test_a_newcomer_goes_before_the_backlog_of_a_tenant_that_floods_its_class():
    queues = ClassQueues(CLASSES, fifo=False)
    for rid in range(1, 11):
        queues.push(job(rid, "a", cost=300))
    assert [j.rid for j in serve(queues, 2)] == [1, 2]
    queues.push(job(11, "b", cost=2))
    queues.push(job(12, "b", cost=2))
    assert [j.rid for j in serve(queues, 3)] == [11, 12, 3]   # b's tokens are few: both before a's next


def test_busy_tenants_get_tokens_in_proportion_to_their_weights():
    queues = ClassQueues(CLASSES, fifo=False)
    for rid in range(40):
        queues.push(job(rid, "heavy"), weight=3.0)
        queues.push(job(100 + rid, "light"), weight=1.0)
    first = [j.client for j in serve(queues, 20)]
    assert first.count("heavy") == 15 and first.count("light") == 5


def test_an_idle_tenant_earns_no_credit_while_away():
    queues = ClassQueues(CLASSES, fifo=False)
    for rid in range(1, 21):
        queues.push(job(rid, "a"))
    serve(queues, 10)
    for rid in range(21, 31):   # b arrives late: it shares from now on, not for the time it was away
        queues.push(job(rid, "b"))
    assert [j.client for j in serve(queues, 6)] == ["b", "a"] * 3


def test_a_retried_job_goes_first_again_in_a_queue_that_emptied_meanwhile():
    queues = ClassQueues(CLASSES, fifo=False)
    queues.push(job(1, "a"))
    queues.push(job(2, "a"))
    retried = serve(queues, 2)[1]   # both on a worker; the queue is empty
    for rid in (3, 4, 5):
        queues.push(job(rid, "b"))
    retried.retries += 1             # its worker died: it comes back
    queues.push_front(retried)
    assert [j.rid for j in serve(queues, 4)] == [2, 3, 4, 5]


def test_aging_counts_from_the_oldest_waiting_job_and_fifo_keeps_arrival_order():
    queues = ClassQueues(CLASSES, fifo=False)
    queues.push(job(1, "a", enqueued=0.0))
    queues.push(job(2, "b", class_name="high", enqueued=5.0))
    assert queues.peek(now=11.0).rid == 1    # a's job waited past normal's max_age_s: it ranks as high
    fifo = ClassQueues(CLASSES, fifo=True)
    for rid, tenant in ((1, "a"), (2, "a"), (3, "b")):
        fifo.push(job(rid, tenant))
    assert [j.rid for j in serve(fifo, 3)] == [1, 2, 3]


def core_with(**scheduler) -> Scheduler:
    tenants = scheduler.pop("tenants", {})
    classes = scheduler.pop("classes", None)
    sections = {"server": {"runtime_dir": tempfile.mkdtemp(prefix="mcpd-f-", dir="/tmp")},
                "cache": {"enabled": False}, "persistence": {"enabled": False},
                "scheduler": {**scheduler, **({"tenants": tenants} if tenants else {}),
                              **({"classes": classes} if classes else {})}}
    return scheduler_of(from_dict(sections), Ports(), Clock())


def flood(core: Scheduler, tenant: str, rids, max_tokens: int = 200) -> None:
    for rid in rids:
        args = GenerateArgs(prompt=f"{tenant} {rid}", sampling=SamplingParams(max_tokens=max_tokens))
        core.on_inbox(*decoded(request(rid, args, tenant=tenant)))
    core.tick()


def test_a_flood_leaves_a_worker_slot_to_another_tenant():
    core = core_with()   # 64 slots a worker, 4 of them kept from a tenant running 4 or more there
    hello(core, 11)
    flood(core, "a", range(1, 65))
    assert len(dispatched(core)) == 60 and len(core.queue) == 4
    flood(core, "b", [100, 101], max_tokens=1)
    assert [d.rid for d in dispatched(core)][60:] == [100, 101]
    from_worker_done(core, 1)   # a slot frees, but a runs 59 and 3 free slots are the headroom
    assert len(dispatched(core)) == 62
    from_worker_done(core, 100, 101)   # b is done: a takes one more, and leaves the headroom again
    assert [d.rid for d in dispatched(core)][62:] == [61]


def from_worker_done(core: Scheduler, *rids: int) -> None:
    from_worker(core, messages.Done(list(rids)))
    core.tick()


def test_a_tenant_at_its_max_running_waits_while_others_go():
    core = core_with(tenants={"a": {"max_running": 2}})
    hello(core, 11)
    flood(core, "a", range(1, 6))
    flood(core, "b", [10])
    assert [d.rid for d in dispatched(core)] == [1, 2, 10]
    from_worker_done(core, 1)
    assert [d.rid for d in dispatched(core)] == [1, 2, 10, 3]


def test_a_tenant_at_its_max_queued_is_refused_and_others_are_not():
    core = core_with(tenants={"*": {"max_queued": 3}})
    flood(core, "a", range(1, 5))   # no worker: everything waits
    refused = core.ports.finals()[4]
    assert refused["code"] == codes.OVERLOADED and "max_queued" in refused["message"] and refused["retry_after_ms"] > 0
    flood(core, "b", [10])
    assert 10 not in core.ports.finals() and len(core.queue) == 4


def test_a_full_class_queue_displaces_the_newest_of_its_biggest_tenant_and_never_evens_out_past_that():
    core = core_with(classes={"normal": {"rank": 1, "max_queue": 4}})
    flood(core, "a", range(1, 5))
    flood(core, "b", [10])
    displaced = core.ports.finals()[4]
    assert displaced["code"] == codes.OVERLOADED and "displaced" in displaced["message"]
    flood(core, "a", [5])                 # a holds 3 of 4: it displaces nobody, not even its own
    assert core.ports.finals()[5]["code"] == codes.OVERLOADED
    flood(core, "b", [11])                # b holds 1, a 3: a gives up its newest again
    assert core.ports.finals()[3]["code"] == codes.OVERLOADED
    flood(core, "b", [12])                # 2 each: even, so b is refused
    assert core.ports.finals()[12]["code"] == codes.OVERLOADED
    assert sorted(j.rid for j in core.jobs.values()) == [1, 2, 10, 11]
    assert len(core.ports.finals()) == 4   # every other request has exactly its one final still to come


def test_a_full_global_queue_displaces_the_biggest_tenant_of_the_newcomers_class():
    core = core_with(max_queue=4)
    flood(core, "a", range(1, 5))
    flood(core, "b", [10])
    assert core.ports.finals()[4]["code"] == codes.OVERLOADED and len(core.queue) == 4


@pytest.mark.parametrize("share, why", [({"weight": 0}, "weight"), ({"weight": 1e308}, "weight"),
                                        ({"max_queued": -1}, "max_queued"), ({"max_running": -1}, "max_running")])
def test_tenant_shares_are_checked(share, why):
    with pytest.raises(ConfigError, match=why):
        from_dict({"scheduler": {"tenants": {"a": share}}})


def test_tenant_shares_apply_on_reload():
    core = core_with()
    flood(core, "a", range(1, 4))
    reloaded = from_dict({"scheduler": {"tenants": {"a": {"max_queued": 3}}}})
    assert "scheduler.tenants" in core.apply_config(reloaded)
    flood(core, "a", [4])
    assert core.ports.finals()[4]["code"] == codes.OVERLOADED and len(core.queue) == 3

"""One tenant's flood does not starve another of its class, on a real daemon: tenant a fills the
worker's slots and the whole queue with long generates; tenant b's 1-token requests are each
admitted (the first by taking the place of a's newest waiting request) and seated at once (the
worker's headroom slots), so all of b's end while every one of a's still runs. The order, not
the clock: a's requests need 1,024 engine steps each, b's one or two."""
from mcpd.config import SchedulerConfig
from mcpd.protocol import codes
from mcpd.testing import final_reply

FLOOD, QUEUE, PER_WORKER = 72, 8, 64
HEADROOM = SchedulerConfig().tenant_headroom
LONG = 1024


def test_a_flooding_tenant_leaves_another_of_its_class_a_place_and_a_seat(fresh_daemon):
    d = fresh_daemon(scheduler={"max_queue": QUEUE, "max_inflight_per_worker": PER_WORKER},
                     engine={"max_num_seqs": PER_WORKER, "pool_bytes": 512 << 20})
    with d.client(tenant="a") as a, d.client(tenant="b") as b:
        flood = [a.send("generate", {"prompt": f"long {i}", "max_tokens": LONG, "ignore_eos": True})
                 for i in range(FLOOD)]
        running = PER_WORKER - HEADROOM
        d.wait_until(lambda: seated_and_queued(b.status(), running), 30, "a's flood seated and queued")
        answers = [b.generate(f"short {i}", max_tokens=1) for i in range(4)]
        assert all(len(answer.token_ids) == 1 for answer in answers)
        for rid in flood:
            a.cancel(rid)
        finals = [final_reply(a, rid) for rid in flood]
    codes_of = [reply.get("code", reply["kind"]) for reply in finals]
    refused = [reply["message"] for reply in finals if reply.get("code") == codes.OVERLOADED]
    assert codes_of.count("ok") == 0, "one of a's long requests ended before b's short ones"
    assert sum("queue is full" in why for why in refused) == FLOOD - running - QUEUE
    assert sum("displaced" in why for why in refused) == 1   # b's first made room; the others found it
    assert codes_of.count(codes.CANCELLED) == running + QUEUE - 1


def seated_and_queued(status: dict, running: int) -> bool:
    return status["queue_depth"] == QUEUE and status["workers"][0]["inflight"] >= running

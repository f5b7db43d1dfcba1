"""Real daemons on loopback sharing a real redis-server: node a, held over its load threshold by
requests queued behind a long one, sends a plain request to node b, which serves it."""
from functools import partial

import pytest

from mcpd.testing import forwarding_node, routing, wait_linked

pytestmark = pytest.mark.slow
THRESHOLD = 2
LONG = {"prompt": "hold", "max_tokens": 2000, "ignore_eos": True}


def test_a_plain_request_on_a_node_over_its_threshold_is_served_by_a_node_under_it(fresh_daemon, redis_server):
    one_at_a_time = {"scheduler": {"max_inflight_per_worker": 1}, "engine": {"max_num_seqs": 1}}
    a = forwarding_node(partial(fresh_daemon, started=False), redis_server.url, "a",
                        cluster={"offload_queued": THRESHOLD}, **one_at_a_time).start()
    b = forwarding_node(partial(fresh_daemon, started=False), redis_server.url, "b").start()
    wait_linked([a, b])
    with a.client() as flood, a.client() as client:
        blocker = flood.send("generate", {**LONG, "stream": True})
        assert flood.receive(blocker)["kind"] == "chunk"
        for _ in range(THRESHOLD + 1):
            flood.send("generate", LONG)
        a.wait_until(lambda: routing(a)["offloading_to"] == "b", what="a over its threshold, offloading to b")
        answer = client.generate("hello", max_tokens=2, ignore_eos=True)
        assert len(answer.token_ids) == 2
    a.wait_until(lambda: routing(b)["received"] == 1 and routing(a)["offloaded"] == 1, what="b serving a's request")
    assert routing(b)["offloaded"] == 0 and routing(a)["received"] == 0

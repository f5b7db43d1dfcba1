"""Real daemons on loopback sharing a real redis-server: a request naming a context that reaches a
node which does not own it is forwarded to the owner's front-end, over ZeroMQ and HTTP alike, and
its replies come back under the client's own request id; a forwarded request is served where it
lands; an owner killed mid-stream still leaves the client a final. And with CURVE on, only a
cluster peer's connection may carry a forwarded request's tenant."""
import json
import os
import signal
import urllib.request
from functools import partial

import numpy as np
import pytest

from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.security.keys import read_public
from mcpd.testing import contexts_owned_by, forwarding_node, routing, wait_linked

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
TENANT = "acme"


def two_nodes(fresh_daemon, redis_server, **sections):
    a, b = (forwarding_node(partial(fresh_daemon, started=False), redis_server.url, name, **sections).start()
            for name in ("a", "b"))
    wait_linked([a, b])
    return a, b


def owned_by_a(count: int = 1) -> list[str]:
    return contexts_owned_by("a", ["a", "b"], TENANT, count)


def held(node) -> int:
    return node.status()["contexts"]["contexts"]


def wait_served_by(a, b, at_least: int) -> None:
    """b sent every request naming a context to a, which served them: the contexts live on a alone.
    (Status figures arrive with each process's next report.)"""
    a.wait_until(lambda: routing(b)["forwarded"] == routing(a)["received"] >= at_least and
                 routing(a)["forwarded"] == 0 and held(a) == 2 and held(b) == 0, what="a serving what b forwarded")


def test_a_context_used_through_another_node_runs_on_its_owner_with_the_same_tokens(fresh_daemon, redis_server):
    a, b = two_nodes(fresh_daemon, redis_server)
    through_b, direct = owned_by_a(2)
    with b.client(tenant=TENANT) as client:
        ctx = client.context(through_b)
        ctx["w"] = np.arange(16, dtype=np.float32)
        ctx.sync()
        forwarded = ctx.generate("hello", **GREEDY)
        assert client.call("context.get", {"id": through_b})["version"] == ctx.version == 2
    with a.client(tenant=TENANT) as client:
        here = client.context(direct)
        here["w"] = np.arange(16, dtype=np.float32)
        here.sync()
        served_here = here.generate("hello", **GREEDY)
    assert forwarded.token_ids == served_here.token_ids and forwarded.text == served_here.text
    wait_served_by(a, b, at_least=4)   # open, update, generate, get


def test_a_forwarded_request_is_served_where_it_lands(fresh_daemon, redis_server):
    """The hop marker: b serves a request another node forwarded, though a owns its context."""
    a, b = two_nodes(fresh_daemon, redis_server)
    (context_id,) = owned_by_a()
    with b.client(tenant=TENANT) as client:
        assert client.call("context.open", {"id": context_id}, hop="a")["version"] == 0
    b.wait_until(lambda: routing(b)["received"] == 1 and held(b) == 1, what="b serving it")
    assert routing(b)["forwarded"] == 0 and routing(a)["received"] == 0 and held(a) == 0


def http_chat(node, context_id: str) -> tuple[dict, str]:
    body = json.dumps({"model": "mcpd-embedded-llama", "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{node.base_url}/contexts/{context_id}/chat/completions", body,
                                     {"Content-Type": "application/json", "mcpd-tenant": TENANT})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer), answer.headers["mcpd-context-version"]


def test_an_http_request_for_a_context_is_forwarded_to_its_owner(fresh_daemon, redis_server):
    a, b = two_nodes(fresh_daemon, redis_server, http={"listen": "127.0.0.1:0"})
    for node in (a, b):
        node.base_url = f"{node.status()['http']['url']}/v1"
    through_b, direct = owned_by_a(2)
    forwarded, version = http_chat(b, through_b)
    served_here, _ = http_chat(a, direct)
    assert version == "1" and forwarded["choices"][0]["message"] == served_here["choices"][0]["message"]
    wait_served_by(a, b, at_least=1)


def test_the_owner_killed_mid_stream_leaves_a_final_and_the_context_goes_on_elsewhere(fresh_daemon, redis_server):
    a, b = two_nodes(fresh_daemon, redis_server)
    (context_id,) = owned_by_a()
    with b.client(tenant=TENANT) as client:
        ctx = client.context(context_id)
        ctx.generate("hello", **GREEDY)
        stream = client.generate("go on", context=context_id, stream=True, max_tokens=2048, ignore_eos=True)
        next(iter(stream))
        for process in a.processes():
            os.kill(process["pid"], signal.SIGKILL)
        with pytest.raises(MCPDError) as lost:
            list(stream)
        assert lost.value.code == codes.UNAVAILABLE and lost.value.retry_after_ms > 0
        retried = client.generate("go on", context=context_id, base=ctx.version, **GREEDY)   # served by b, from Redis
        assert retried.context.version == ctx.version + 1
    b.wait_until(lambda: routing(b)["owner_lost"] == 1 and routing(b)["owner_unreachable"] >= 1,
                 what="b counting the owner lost, then unreachable")


def test_with_curve_only_a_cluster_peer_may_carry_a_forwarded_requests_tenant(fresh_daemon):
    """A client holding its own key and forging the hop marker gets no more than its own tenant."""
    node = fresh_daemon(security={"curve": "on"}, cluster={"peer_tenants": ["node-b"]})
    with node.client(curve=node.curve_keys("mallory")) as mallory:
        with pytest.raises(MCPDError) as forged:
            mallory.call("context.open", {"id": "chat"}, hop="b", tenant=TENANT)
        assert forged.value.code == codes.UNAUTHORIZED
    with node.client(curve=node.curve_keys("node-b")) as peer:
        with pytest.raises(MCPDError) as unmarked:   # a peer's key without the marker is its own tenant only
            peer.call("context.open", {"id": "chat"}, tenant=TENANT)
        assert unmarked.value.code == codes.UNAUTHORIZED
        assert peer.call("context.open", {"id": "chat"}, hop="b", tenant=TENANT)["version"] == 0
    with node.client(curve=node.curve_keys(TENANT)) as owner:
        assert owner.call("context.get", {"id": "chat"})["version"] == 0   # made in acme's name


def test_with_curve_nodes_forward_as_cluster_peers_and_the_owner_serves_the_clients_tenant(fresh_daemon, redis_server):
    a, b = (forwarding_node(partial(fresh_daemon, started=False), redis_server.url, name, security={"curve": "on"},
                            cluster={"peer_tenants": ["node-a", "node-b"]}).start() for name in ("a", "b"))
    for node, other in ((a, b), (b, a)):   # each allows the other's server key under its peer name
        node.control("keys.allow", {"name": f"node-{other.node_id}",
                                    "public_key": read_public(other.root / "state/keys/server.key")})
    wait_linked([a, b])
    (context_id,) = owned_by_a()
    with b.client(curve=b.curve_keys(TENANT)) as client:
        assert client.call("context.open", {"id": context_id})["version"] == 0
    b.wait_until(lambda: routing(b)["forwarded"] == 1 and routing(a)["received"] == 1, what="a serving it for b")
    with a.client(curve=a.curve_keys(TENANT)) as client:
        assert client.call("context.get", {"id": context_id})["version"] == 0   # made on a, in acme's name
    assert held(a) == 1 and held(b) == 0

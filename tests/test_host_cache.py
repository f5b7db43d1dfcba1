"""The host shared-memory cache through the real daemon (2 CPU workers): a chat resumes from it
after its workers die, a restarted scheduler gets every committed context back bit-identical,
a commit the cache cannot hold is refused whole, and mcpctl shows the figures."""
import os
import signal

import numpy as np
import pytest

from mcpd.client import Client
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
BLOCK = 16
CACHE_BYTES = 8 << 20


@pytest.fixture(scope="module")
def daemon(module_daemon):
    # Private device pools: a restarted worker has none of its KV, so the host cache is what it
    # resumes from (with the shared pool it resumes from the device: test_pool_keeper.py).
    return module_daemon(workers={"count": 2, "threads": 1}, cache={"bytes": CACHE_BYTES}, pool={"shared": False})


def cache_status(d) -> dict:
    return d.status()["cache"]


def kill_and_wait(d, role: str, index: int = 0) -> None:
    old = d.pid_of(role, index)
    os.kill(old, signal.SIGKILL)
    d.wait_until(lambda: d.pid_of(role, index) not in (None, old) and d.status()["state"] == "ready",
                 120, f"{role} {index} restarted")


@pytest.mark.slow
def test_chat_resumes_from_the_host_cache_after_its_workers_die(daemon):
    with Client(daemon.endpoint, tenant="chatter", timeout=120) as client, \
            Client(daemon.endpoint, tenant="recompute", timeout=120) as cold:
        ctx = client.context("long-chat")
        ctx.generate("Tell me a long story about the sea. " * 8, **GREEDY)
        ctx.generate(" And then what happened next? " * 4, **GREEDY)
        history = [int(t) for t in ctx.tokens]
        for index in (0, 1):   # no device anywhere keeps the chat's KV
            kill_and_wait(daemon, "worker", index)
        result = ctx.generate(" Go on.", **GREEDY)
        # The restarted workers computed only the turn and the history's last partial block.
        history_blocks = (len(history) - 1) // BLOCK
        daemon.wait_until(lambda: cache_status(daemon)["kv_blocks_loaded"] >= history_blocks > 10, 30,
                          "the history's blocks loaded from the cache")
        appended = result.context.appended_token_ids
        full = history + appended[:len(appended) - len(result.token_ids)]
        assert result.token_ids == cold.generate(prompt_token_ids=full, **GREEDY).token_ids


def test_status_shows_the_cache_and_its_figures_move(daemon):
    with Client(daemon.endpoint, tenant="status", timeout=120) as client:
        context = client.context("s")
        context.generate("Hello " * 40, **GREEDY)
        for index in (0, 1):   # no worker keeps its KV: the next turn reads it from the cache (hits)
            kill_and_wait(daemon, "worker", index)
        context.generate(" again", **GREEDY)
    daemon.wait_until(lambda: cache_status(daemon)["contexts"] >= 1 and cache_status(daemon)["hits"] > 0, 30, "stats")
    cache = cache_status(daemon)
    assert cache["enabled"] and cache["total_bytes"] <= CACHE_BYTES and 0 < cache["used_bytes"] <= cache["total_bytes"]
    assert cache["kv_blocks"] > 0 and cache["entries"] == cache["contexts"] + cache["context_deltas"] + cache["kv_blocks"]
    assert 0 < cache["hit_rate"] <= 1
    text = daemon.mcpctl("status").stdout
    assert f"contexts {cache['contexts']}" in text and "hit rate" in text


def test_commit_the_cache_cannot_hold_is_refused_and_the_context_is_unchanged(daemon):
    with daemon.client() as client:
        ctx = client.context("too-big")
        ctx["small"] = np.arange(10, dtype=np.int16)
        ctx.sync()
        ctx["huge"] = np.ones(CACHE_BYTES // 4, np.float32)   # the whole cache on its own
        with pytest.raises(MCPDError) as raised:
            ctx.sync()
        assert raised.value.code == codes.TOO_LARGE and "cache" in raised.value.message
        again = client.context("too-big")
        assert again.version == 1 and "huge" not in again and np.array_equal(again["small"], np.arange(10))
        again["next"] = "fits"
        assert again.sync() == 2


FIELDS = {
    "f32": np.random.default_rng(1).standard_normal((33, 7)).astype(np.float32),
    "be_i64": np.arange(-5, 20, dtype=">i8"),
    "f16": np.array([1.5, np.inf, -0.0], np.float16),
    "nan": np.array([np.nan, 1.0]),
    "bools": np.array([[True, False], [False, True]]),
    "u8_empty": np.zeros((0, 3), np.uint8),
    "blob": bytes(range(256)) * 3,
    "text": "héllo, wörld",
    "count": 2 ** 63 + 5,
    "ratio": -0.125,
    "flag": True,
}


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b


@pytest.mark.slow
def test_killed_scheduler_comes_back_with_every_committed_context(daemon):
    with Client(daemon.endpoint, tenant="keeper", timeout=120) as client:
        chat = client.context("chat")
        chat.generate("Remember this conversation.", **GREEDY)
        chat.generate(" And this turn too.", **GREEDY)
        data = client.context("data")
        for name, value in FIELDS.items():
            data[name] = value
        data["gone"] = "soon"
        data.sync()
        del data["gone"]
        data.sync()
        before = {"chat": (chat.version, chat.tokens.copy()), "data": data.version}
        chat_v1 = 1

    kill_and_wait(daemon, "scheduler")

    with Client(daemon.endpoint, tenant="keeper", timeout=120) as client:
        daemon.wait_until(lambda: all(w["ready"] for w in client.status()["workers"]) and
                          len(client.status()["workers"]) == 2, 60, "workers known to the new scheduler")
        data = client.context("data", create=False)
        assert data.version == before["data"] and "gone" not in data
        for name, value in FIELDS.items():
            assert same(data[name], value), name
        chat = client.context("chat", create=False)
        assert chat.version == before["chat"][0] and same(chat.tokens, before["chat"][1])
        since = client.call("context.get", {"id": "chat", "since": chat_v1})   # bookkeeping came back too
        assert [c["kind"] for c in since["changes"]] == ["append"]
        history = [int(t) for t in chat.tokens]
        result = chat.generate(" Still there?", **GREEDY)   # work continues on the restored context
        assert result.context.version == before["chat"][0] + 1
        appended = result.context.appended_token_ids
        full = history + appended[:len(appended) - len(result.token_ids)]
        with Client(daemon.endpoint, tenant="recompute-2", timeout=120) as cold:
            assert result.token_ids == cold.generate(prompt_token_ids=full, **GREEDY).token_ids

"""Contexts through the real daemon: turns equal a full recompute, deltas sync, conflicts, isolation."""
import msgpack
import numpy as np
import pytest
import zmq

from mcpd.client import Client
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError

GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def recompute(client: Client, history: np.ndarray, appended: list[int], output: list[int]) -> list[int]:
    """What a stateless generate over the whole history + the turn's prompt produces."""
    prompt = [int(t) for t in history] + appended[:len(appended) - len(output)]
    return client.generate(prompt_token_ids=prompt, **GREEDY).token_ids


def test_chat_turns_match_full_recompute(daemon):
    with daemon.client() as client:
        ctx = client.context("chat-1")
        for turn in ["Hello there.", " How are you?", " Tell me more."]:
            history = ctx.tokens.copy()
            result = ctx.generate(turn, **GREEDY)
            appended = result.context.appended_token_ids
            assert result.token_ids == recompute(client, history, appended, result.token_ids)
            assert list(ctx.tokens) == list(history) + appended
        assert ctx.version == 3
        ctx.drop()


def test_chat_messages_append_rendered_turns_after_what_they_keep(daemon):
    with daemon.client() as client:
        ctx = client.context("chat-msgs")
        first = ctx.chat("user", "hi", **GREEDY)
        after_first = list(ctx.tokens)
        second = ctx.chat("user", "again", **GREEDY)
        assert second.context.version == 2
        # kept_tokens: the first answer's tail that its text (the client's) does not spell was replaced
        kept = second.context.kept_tokens
        kept = len(first.context.appended_token_ids) if kept is None else kept
        held = list(client.context("chat-msgs", create=False).tokens)   # the daemon's, not the mirror's
        assert held == list(ctx.tokens) == after_first[:kept] + second.context.appended_token_ids


def test_fields_sync_both_ways_and_deltas_are_small(daemon):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(250_000).astype(np.float32)   # 1 MB
    with daemon.client() as a, daemon.client() as b:
        mine = a.context("fields")
        mine["weights"] = weights
        mine["label"] = "v1"
        mine["step"] = 3
        mine.sync()
        theirs = b.context("fields")
        assert np.array_equal(theirs["weights"], weights) and theirs["label"] == "v1" and theirs["step"] == 3

        changed = weights.copy()
        changed[rng.choice(weights.size, 2500, replace=False)] += 1.0   # 1% of elements
        mine["weights"] = changed
        change = codec.diff("weights", weights, changed)
        assert change.kind == "xor" and len(change.data) < 0.05 * weights.nbytes
        del mine["label"]
        mine.sync()
        theirs.refresh()
        assert np.array_equal(theirs["weights"], changed) and "label" not in theirs
        assert theirs.version == mine.version


def test_concurrent_updates_one_wins_one_conflicts(daemon):
    with daemon.client() as a, daemon.client() as b:
        a.call("context.open", {"id": "race"})
        entries, frames = codec.to_wire([codec.diff("x", None, np.arange(4, dtype=np.int64))])
        a_id = a.send("context.update", {"id": "race", "base": 0, "changes": entries}, frames)
        b_id = b.send("context.update", {"id": "race", "base": 0, "changes": entries}, frames)
        outcomes = []
        for client, rid in ((a, a_id), (b, b_id)):
            reply = client.receive(rid)
            outcomes.append(reply["kind"] if reply["kind"] == "ok" else reply["code"])
        assert sorted(outcomes) == [codes.CONFLICT, "ok"]


def test_mirror_resyncs_after_conflict(daemon):
    with daemon.client() as a, daemon.client() as b:
        first, second = a.context("rebase"), b.context("rebase")
        first["a"] = np.ones(3)
        first.sync()
        second["b"] = np.zeros(2)
        second.sync()   # stale base: CONFLICT inside, then refresh and retry
        assert "a" in second and "b" in second and second.version == 2
        first.refresh()
        assert np.array_equal(first["b"], np.zeros(2))


def raw_update(daemon, context_id, base, entries, frames):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(daemon.endpoint)
    header = msgpack.packb({"v": 1, "op": "context.update", "id": 1,
                            "args": {"id": context_id, "base": base, "changes": entries}})
    sock.send_multipart([header, *frames])
    reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    sock.close()
    return reply


def zstd_bomb() -> bytes:
    import zstandard
    return zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))   # declares 64 MiB


@pytest.mark.parametrize("entry, frame, code", [
    ({"name": "w", "kind": "set", "meta": {"type": "array", "dtype": "<f4", "shape": [4], "codec": "zstd", "nbytes": 16}, "frame": 0},
     zstd_bomb(), codes.BAD_REQUEST),
    ({"name": "w", "kind": "set", "meta": {"type": "array", "dtype": "<f4", "shape": [4], "codec": "raw", "nbytes": 16}, "frame": 0},
     b"\0" * 7, codes.BAD_REQUEST),                                                     # truncated
    ({"name": "w", "kind": "xor", "meta": {"type": "array", "dtype": "<f4", "shape": [5], "codec": "raw", "nbytes": 20}, "frame": 0},
     b"\0" * 20, codes.BAD_REQUEST),                                                    # shape mismatch
    ({"name": "w", "kind": "xor", "meta": {"type": "array", "dtype": "<i4", "shape": [4], "codec": "raw", "nbytes": 16}, "frame": 0},
     b"\0" * 16, codes.BAD_REQUEST),                                                    # dtype mismatch
    ({"name": "w", "kind": "set", "meta": {"type": "array", "dtype": "|O", "shape": [1], "codec": "raw", "nbytes": 8}, "frame": 0},
     b"\0" * 8, codes.BAD_REQUEST),                                                     # object dtype
])
def test_hostile_deltas_leave_the_context_unchanged(daemon, entry, frame, code):
    with daemon.client() as client:
        ctx = client.context("hostile")
        ctx["w"] = np.arange(4, dtype=np.float32)
        ctx.sync()
        before = ctx.version
        reply = raw_update(daemon, "hostile", before, [entry], [frame])
        assert reply["kind"] == "error" and reply["code"] in (code, codes.TOO_LARGE), reply
        again = client.context("hostile")
        assert again.version == before and np.array_equal(again["w"], np.arange(4, dtype=np.float32))
        assert client.ping()["pong"] is True


def test_tenants_cannot_see_each_other(daemon):
    with Client(daemon.endpoint, tenant="alice") as alice, Client(daemon.endpoint, tenant="bob") as bob:
        secret = alice.context("diary")
        secret["text"] = "mine"
        secret.sync()
        for op, args in [("context.get", {"id": "diary"}),
                         ("context.update", {"id": "diary", "base": 1, "changes": []}),
                         ("context.open", {"id": "diary", "create": False})]:
            with pytest.raises(MCPDError) as raised:
                bob.call(op, args)
            assert raised.value.code == codes.NOT_FOUND, op
        assert bob.call("context.drop", {"id": "diary"})["dropped"] is False
        with pytest.raises(MCPDError) as raised:
            bob.generate("x", context="diary", max_tokens=1)
        assert raised.value.code == codes.NOT_FOUND
        assert bob.call("context.list", {})["contexts"] == []
        assert [c["id"] for c in alice.call("context.list", {})["contexts"]] == ["diary"]
        own = bob.context("diary")   # the same id under another tenant is another context
        own["text"] = "bob's own"
        own.sync()
        assert alice.context("diary")["text"] == "mine"


def test_get_since_sends_only_the_token_suffix(daemon):
    with daemon.client() as client:
        ctx = client.context("since")
        ctx.generate("abc", **GREEDY)
        v1, n1 = ctx.version, len(ctx.tokens)
        ctx.generate("def", **GREEDY)
        result, frames = client.call_with_payload("context.get", {"id": "since", "since": v1})
        (entry,) = result["changes"]
        assert entry["name"] == "tokens" and entry["kind"] == "append"
        assert sum(len(f) for f in frames) <= (len(ctx.tokens) - n1) * 4


@pytest.mark.slow
def test_context_moves_to_another_worker_mid_chat(fresh_daemon):
    import os
    import signal

    d = fresh_daemon(workers={"count": 2, "threads": 1})
    with d.client() as client:
        ctx = client.context("travel")
        ctx.generate("First turn.", **GREEDY)
        d.wait_until(lambda: any(w.get("tokens_generated") for w in d.status()["devices"]), 10, "stats")
        holder = next(w["worker"] for w in d.status()["devices"] if w.get("tokens_generated"))
        os.kill(d.pid_of("worker", holder), signal.SIGKILL)
        history = ctx.tokens.copy()
        result = ctx.generate(" Second turn.", **GREEDY)   # the other worker: no KV there, recomputes
        appended = result.context.appended_token_ids
        assert result.token_ids == recompute(client, history, appended, result.token_ids)
        assert ctx.version == 2


def test_in_place_writes_to_a_synced_array_are_synced(daemon):
    with daemon.client() as a, daemon.client() as b:
        mine = a.context("in-place")
        mine["w"] = np.zeros(8, np.float32)
        mine.sync()
        mine["w"][3] = 7.0            # no assignment: the mirror must still see the change
        assert mine.dirty
        mine.sync()
        assert b.context("in-place")["w"][3] == 7.0


@pytest.mark.slow
def test_daemon_wide_context_limits(fresh_daemon):
    d = fresh_daemon(contexts={"max_contexts": 2, "max_total_bytes": 1 << 16})
    with Client(d.endpoint, tenant="a") as a, Client(d.endpoint, tenant="b") as b:
        a.context("one")
        big = b.context("two")
        with pytest.raises(MCPDError) as raised:
            b.context("three")
        assert raised.value.code == codes.TOO_LARGE
        big["blob"] = np.zeros(1 << 15, np.float32)   # 128 KiB: over the daemon-wide byte limit
        with pytest.raises(MCPDError) as raised:
            big.sync()
        assert raised.value.code == codes.TOO_LARGE
        assert a.call("context.list", {})["contexts"][0]["id"] == "one"


def test_a_refused_sync_leaves_the_mirror_able_to_sync_again(daemon):
    """The mirror adopts XORed fields while the daemon works; a refusal must undo that exactly."""
    rng = np.random.default_rng(1)
    with daemon.client() as client:
        ctx = client.context("refused")
        ctx["w"] = rng.standard_normal(100_000).astype(np.float32)
        ctx.sync()
        ctx["w"][::10] += 1   # travels as an xor delta
        ctx["tokens"] = np.array([-1], np.int32)   # the daemon refuses the whole update for this
        with pytest.raises(MCPDError) as refused:
            ctx.sync()
        assert refused.value.code == codes.BAD_REQUEST
        ctx["tokens"] = np.zeros(0, np.int32)
        ctx.sync()
        assert client.context("refused")["w"].tobytes() == ctx["w"].tobytes()
        ctx.drop()

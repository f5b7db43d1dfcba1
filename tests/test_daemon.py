"""The daemon end to end: real processes, real sockets, the bundled client and mcpctl."""
import json

import pytest

from mcpd.kernels import native
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError


def test_ping_goes_through_a_worker(daemon):
    with daemon.client() as client:
        assert client.ping() == {"pong": True, "worker": 0}


def test_generate_returns_text_and_tokens(daemon):
    with daemon.client() as client:
        result = client.generate("Hello", max_tokens=8, temperature=0, ignore_eos=True)
    assert len(result.token_ids) == 8 and result.completion_tokens == 8
    assert result.finish_reason == "length"
    assert isinstance(result.text, str) and result.prompt_tokens > 0


def test_greedy_is_deterministic_and_seed_reproduces(daemon):
    with daemon.client() as client:
        a = client.generate("abc", max_tokens=6, temperature=0, ignore_eos=True)
        b = client.generate("abc", max_tokens=6, temperature=0, ignore_eos=True)
        s1 = client.generate("abc", max_tokens=6, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
        s2 = client.generate("abc", max_tokens=6, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert s1.token_ids == s2.token_ids


def test_stream_chunks_add_up_to_the_result(daemon):
    with daemon.client() as client:
        stream = client.generate("Stream me", max_tokens=12, temperature=0, ignore_eos=True, stream=True)
        chunks = list(stream)
        full = client.generate("Stream me", max_tokens=12, temperature=0, ignore_eos=True)
    assert len(chunks) >= 2
    assert [t for c in chunks for t in c.token_ids] == stream.result.token_ids == full.token_ids
    assert "".join(c.text for c in chunks) == stream.result.text == full.text


def test_one_client_reads_a_stream_and_a_request_at_once(daemon):
    """A stream's chunks that arrive while the client waits for another request's reply are kept
    for the stream, none lost and none taken for the other's reply."""
    with daemon.client() as client:
        alone = [client.generate(p, max_tokens=10, temperature=0, ignore_eos=True).token_ids for p in ("one", "two")]
        streamed = client.generate("one", max_tokens=10, temperature=0, ignore_eos=True, stream=True)
        # the stream's chunks arrive while this waits for its own reply
        waited = client.generate("two", max_tokens=10, temperature=0, ignore_eos=True)
        chunks = list(streamed)
    assert [[t for chunk in chunks for t in chunk.token_ids], waited.token_ids] == alone
    assert streamed.result.token_ids == alone[0]


def test_stop_string_ends_generation(daemon):
    with daemon.client() as client:
        free = client.generate("x", max_tokens=24, temperature=0, ignore_eos=True)
        if len(free.text) < 4:
            pytest.skip("embedded model produced too little text to pick a stop string")
        stop = free.text[2:4]
        stopped = client.generate("x", max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(stop)]


def test_cancel_a_running_stream(daemon):
    with daemon.client() as client:
        stream = client.generate("Go on", max_tokens=2000, temperature=0, ignore_eos=True, stream=True)
        iterator = iter(stream)
        next(iterator)
        assert stream.cancel() is True
        with pytest.raises(MCPDError) as raised:
            for _ in iterator:
                pass
        assert raised.value.code == codes.CANCELLED
        assert client.cancel(stream.request_id) is False   # already over
        assert client.ping()["pong"] is True


def test_client_timeout_raises_timeout(daemon):
    with daemon.client() as client:
        with pytest.raises(MCPDError) as raised:
            client.generate("slow", max_tokens=2000, ignore_eos=True, timeout=0.3)
        assert raised.value.code == codes.TIMEOUT
        assert client.ping()["pong"] is True


def test_status_op_reports_workers(daemon):
    with daemon.client() as client:
        status = client.status()
    assert status["workers"][0]["ready"] is True
    assert "queue_depth" in status


def test_mcpctl_status_json(daemon):
    with daemon.client() as client:
        client.ping()
    daemon.wait_until(lambda: daemon.status()["requests"]["served"] > 0, 10, "served count")
    done = daemon.mcpctl("status", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    roles = sorted(p["role"] for p in status["processes"])
    assert roles == ["frontend", "keeper", "scheduler", "supervisor", "worker"]
    assert all(p["state"] == "running" and p["pid"] for p in status["processes"])
    assert status["healthy"] is True and status["state"] == "ready"
    assert status["devices"][0]["device"] == "cpu"
    assert status["devices"][0]["kernels"] in (*(f"native-{isa}" for isa in native.ISAS), "torch")   # as the CPU allows
    assert status["requests"]["latency"]["ping"]["p50_ms"] > 0


def test_mcpctl_status_table(daemon):
    with daemon.client() as client:   # a request of its own: the latency rows show served requests
        client.ping()
    daemon.wait_until(lambda: daemon.status()["requests"]["served"] > 0, 10, "served count")
    done = daemon.mcpctl("status")
    assert done.returncode == 0, done.stderr
    assert "scheduler" in done.stdout and "p50" in done.stdout and "KERNELS" in done.stdout


def test_mcpctl_unreachable_exit_code(tmp_path):
    from mcpd.testing import BIN
    import subprocess
    done = subprocess.run([str(BIN / "mcpctl"), "--runtime-dir", str(tmp_path), "status"],
                          capture_output=True, text=True)
    assert done.returncode == 3
    assert "is mcpd running" in done.stderr


def test_async_client_generate_stream_and_concurrency(daemon):
    import asyncio

    from mcpd.client import AsyncClient

    async def scenario():
        async with AsyncClient(daemon.endpoint) as client:
            assert (await client.ping())["pong"] is True
            results = await asyncio.gather(*[client.generate(f"p{i}", max_tokens=5, temperature=0, ignore_eos=True)
                                             for i in range(4)])
            chunks = [c async for c in client.stream("p0", max_tokens=5, temperature=0, ignore_eos=True)]
            return results, chunks

    results, chunks = asyncio.run(scenario())
    assert all(r.completion_tokens == 5 for r in results)
    assert [t for c in chunks for t in c.token_ids] == results[0].token_ids


def test_a_request_over_the_header_limit_fails_at_once_in_both_clients(daemon):
    """The daemon's TOO_LARGE carries no id (sizes are checked before decoding); a client with
    that one request in flight takes it as its answer instead of waiting out its timeout."""
    import asyncio

    from mcpd.client import AsyncClient

    # Past this daemon's limits.max_header_bytes (8 KiB), within its max_message_bytes (1 MiB):
    # a frame past that one is ZMQ_MAXMSGSIZE's, and libzmq drops the connection unanswered.
    too_long = "p" * 100_000
    with daemon.client(timeout=60) as client, pytest.raises(MCPDError) as refused:
        client.generate(too_long, max_tokens=1)
    assert refused.value.code == codes.TOO_LARGE

    async def scenario():
        async with AsyncClient(daemon.endpoint, timeout=60) as client:
            with pytest.raises(MCPDError) as raised:
                await client.generate(too_long, max_tokens=1)
            return raised.value.code, (await client.ping())["pong"]

    assert asyncio.run(scenario()) == (codes.TOO_LARGE, True)


def test_nil_arguments_mean_the_default(daemon):
    with daemon.client() as client:
        result = client.call("generate", {"prompt": "x", "max_tokens": None, "temperature": None,
                                          "stop": None, "ignore_eos": True})
    assert len(result["token_ids"]) == 16   # the documented default max_tokens


def test_long_token_prompt_reaches_the_engine_check(daemon):
    """A prompt of more token ids than the msgpack map cap is decoded and judged by length."""
    with daemon.client() as client:
        with pytest.raises(MCPDError) as raised:
            client.generate(prompt_token_ids=[65] * 5000, max_tokens=1)
    assert raised.value.code == codes.BAD_REQUEST
    assert "msgpack" not in raised.value.message


@pytest.mark.slow
def test_stream_chunks_are_capped_per_second_and_lose_nothing(fresh_daemon):
    """At 2 chunks/s a 40-token stream gets at most the first chunk plus two a second of its
    duration (the embedded model makes a token per chunk otherwise), and every token and every
    character still arrives."""
    import time
    d = fresh_daemon(limits={"max_stream_chunks_per_s": 2.0})
    with d.client() as client:
        started = time.monotonic()
        stream = client.generate("count", max_tokens=40, ignore_eos=True, temperature=0, stream=True)
        chunks = list(stream)
        elapsed = time.monotonic() - started
    assert len(chunks) <= 2 + 2 * elapsed   # the first chunk, then one per half second at most
    assert [t for c in chunks for t in c.token_ids] == stream.result.token_ids
    assert "".join(c.text for c in chunks) == stream.result.text


def test_clients_send_priority_and_deadline(daemon):
    import asyncio

    from mcpd.client import AsyncClient

    with daemon.client() as client:
        with pytest.raises(MCPDError) as unknown:
            client.generate("x", max_tokens=2, priority="no-such-class")
        assert unknown.value.code == codes.BAD_REQUEST and "no-such-class" in unknown.value.message
        assert client.generate("x", max_tokens=2, ignore_eos=True, priority="high").completion_tokens == 2

    async def late():
        async with AsyncClient(daemon.endpoint) as client:
            await client.generate("x", max_tokens=2000, ignore_eos=True, timeout_ms=200, priority="low")

    with pytest.raises(MCPDError) as expired:
        asyncio.run(late())
    assert expired.value.code == codes.DEADLINE_EXCEEDED


def test_bfloat16_on_a_cpu_without_bf16_instructions_is_served_and_warned_of(fresh_daemon):
    """The operator's dtype is kept; the log says when this CPU will run it far slower."""
    from mcpd.cpu import features
    d = fresh_daemon(model={"dtype": "bfloat16"})
    with d.client() as client:
        assert client.generate("bf16", max_tokens=2, ignore_eos=True).completion_tokens == 2
    assert ("model.dtype = bfloat16 on a CPU without bf16 instructions" in d.log()) != features.has_bf16()

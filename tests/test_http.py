"""The OpenAI-compatible HTTP listener on a real daemon (127.0.0.1), driven by the real `openai`
package (sync and async, streamed and not), raw HTTP for what the SDK hides, and curl for SSE."""
import asyncio
import gzip
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.request

import openai
import pytest

from mcpd.client import Client
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.testing import free_port

MODEL = "mcpd-embedded-llama"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(module_daemon):
    daemon = module_daemon(http={"listen": f"127.0.0.1:{free_port()}", "max_body_bytes": 65536,
                                 "body_timeout_s": 1.0}, metrics={"listen": f"127.0.0.1:{free_port()}"})
    daemon.base_url = f"http://{daemon.control('config')['config']['http']['listen']}/v1"
    return daemon


@pytest.fixture(scope="module")
def sdk(served):
    with openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0) as client:
        yield client


def raw(daemon, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one request on a fresh connection."""
    host, port = daemon.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, dict(response.headers), json.loads(payload) if payload else {}


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            **extra}


# -- the SDK, unchanged -------------------------------------------------------------------------

def test_models_lists_the_served_model(sdk):
    assert [m.id for m in sdk.models.list()] == [MODEL]


def test_a_model_is_retrieved_by_its_id(served, sdk):
    model = sdk.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "mcpd")
    status, _, body = raw(served, "GET", "/v1/models/no-such-model")
    assert status == 404 and body["error"]["code"] == "UNKNOWN_MODEL" and body["error"]["param"] == "model"


def test_a_chat_without_max_tokens_gets_the_room_the_context_has_left(sdk):
    """As vLLM: a long prompt and no max_tokens is not refused for prompt + max_new_tokens
    exceeding max_model_len (4096 here); the answer ends where the context does."""
    answer = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a" * 4060}],
                                         temperature=0)
    assert answer.usage.prompt_tokens > 4060 - 2048
    assert (answer.usage.total_tokens, answer.choices[0].finish_reason) == (4096, "length")   # to the end


def test_chat_matches_the_zeromq_answer(served, sdk):
    answer = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                         temperature=0)
    with served.client() as zmq_client:
        native = zmq_client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0)
    assert answer.choices[0].message.content == native.text
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == native.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (native.prompt_tokens, 5)
    assert answer.usage.total_tokens == native.prompt_tokens + 5


def test_streamed_chat_concatenates_to_the_whole_answer_and_ends_with_usage(sdk):
    whole = sdk.chat.completions.create(**chat_body(max_tokens=8))
    chunks = list(sdk.chat.completions.create(**chat_body(max_tokens=8), stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streamed_and_not(sdk):
    whole = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0)
    streamed = list(sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
    by_ids = sdk.completions.create(model=MODEL, prompt=[256, 72, 105], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 3


def test_a_prompt_over_max_prompt_tokens_is_refused_naming_the_limit(served):
    """The header's array bound trips first: its refusal names the setting, not the encoding."""
    with Client(served.endpoint) as client, pytest.raises(MCPDError) as refused:
        client.generate(prompt_token_ids=[1] * 40_000, max_tokens=1)
    assert refused.value.code == codes.BAD_REQUEST
    assert "limits.max_prompt_tokens" in refused.value.message and "not valid msgpack" not in refused.value.message


def test_sampling_parameters_are_honoured(sdk):
    seeded = [sdk.chat.completions.create(**chat_body(temperature=0.9, top_p=0.8, seed=7, max_tokens=6))
              .choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    free = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0).choices[0].text
    stop = next(character for character in free[1:] if character != "\ufffd")   # one the answer reaches
    stopped = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stop=[stop])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (free[:free.index(stop)], "stop")
    short = sdk.chat.completions.create(**{**chat_body(), "max_tokens": None}, max_completion_tokens=2)
    assert short.usage.completion_tokens == 2


def test_async_client_streams_and_answers(served):
    async def go():
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0) as client:
            whole = await client.chat.completions.create(**chat_body(max_tokens=6))
            stream = await client.chat.completions.create(**chat_body(max_tokens=6), stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            # ignore_eos: sampled at OpenAI's default temperature, an end token within 3 tokens is luck, not a bug
            together = await asyncio.gather(*[client.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=3,
                                                                        extra_body={"ignore_eos": True})
                                             for i in range(4)])
            return whole.choices[0].message.content, text, together
    whole, text, together = asyncio.run(go())
    assert text == whole and [r.usage.completion_tokens for r in together] == [3] * 4


def test_logprobs_come_with_token_ids(sdk):
    answer = sdk.chat.completions.create(**chat_body(logprobs=True))
    content = answer.choices[0].logprobs.content
    assert len(content) == 4 and all(c.token.startswith("token_id:") and c.logprob <= 0 for c in content)


# -- refusals in OpenAI's error shape ------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    (chat_body(n=2), "n"),
    (chat_body(max_tokens="4"), "max_tokens"),
    (chat_body(max_tokens=4.0), "max_tokens"),
    (chat_body(temperature=True), "temperature"),
    (chat_body(messages="hi"), "messages"),
    (chat_body(messages=[]), "messages"),
    (chat_body(stop=[1]), "stop"),
    (chat_body(stream_options={"include_usage": True}), "stream_options"),
    (chat_body(top_logprobs=3), "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_wrong_fields_get_400_naming_them(served, body, param):
    status, _, answer = raw(served, "POST", "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(served):
    status, _, answer = raw(served, "POST", "/v1/chat/completions", chat_body(user="u1", some_new_field={"x": 1}))
    assert status == 200 and answer["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("field", [{"max_tokens": 10 ** 6}, {"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}])
def test_the_daemons_range_checks_come_back_as_400(sdk, field):
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(**chat_body(**field))
    assert raised.value.code == "BAD_REQUEST"


def test_bad_json_unknown_model_path_and_method(served):
    assert raw(served, "POST", "/v1/chat/completions", b"{not json")[0] == 400
    assert raw(served, "POST", "/v1/chat/completions", b"[1, 2]")[0] == 400
    status, _, answer = raw(served, "POST", "/v1/chat/completions", chat_body(model="gpt-4o"))
    assert status == 404 and answer["error"]["param"] == "model"
    status, _, answer = raw(served, "POST", "/v1/chat/completions", chat_body(model="m" * 20_000))
    assert status == 404 and len(answer["error"]["message"]) < 200   # the name is not echoed whole
    assert raw(served, "POST", "/v1/nothing", chat_body())[0] == 404
    assert raw(served, "GET", "/v1/chat/completions")[0] == 405


def test_a_body_over_the_limit_is_refused_before_it_is_read(served):
    status, _, answer = raw(served, "POST", "/v1/chat/completions", b"x" * 65537)
    assert status == 413 and answer["error"]["code"] == "TOO_LARGE"


def test_a_chunked_body_over_the_limit_gets_413(served):
    host, port = served.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(40):
            sock.sendall(b"1000\r\n" + b"x" * 4096 + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 413")


def test_a_body_that_never_arrives_gets_408(served):
    host, port = served.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        sock.settimeout(30)
        assert sock.recv(100).startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("encoding, body", [("gzip", b"\x1f\x8b" + b"\0" * 20),
                                            ("gzip", gzip.compress(json.dumps(chat_body()).encode()) + b"junk"),
                                            ("deflate", b"not deflate"), ("br", json.dumps(chat_body()).encode())],
                         ids=["gzip-junk", "gzip-trailing-junk", "deflate-junk", "br"])
def test_a_body_that_does_not_decode_as_its_content_encoding_says_is_400_and_closes(served, encoding, body):
    """A gzip body is taken; one that does not inflate, or an encoding aiohttp cannot decode
    here (br without brotli), is the client's error, not a 500 with a traceback in the log."""
    assert raw(served, "POST", "/v1/chat/completions", gzip.compress(json.dumps(chat_body()).encode()),
               {"Content-Encoding": "gzip"})[0] == 200
    status, headers, answer = raw(served, "POST", "/v1/chat/completions", body, {"Content-Encoding": encoding})
    assert status == 400 and answer["error"]["code"] == "BAD_REQUEST"
    assert f"content-encoding: {encoding}" in answer["error"]["message"]
    assert headers["Connection"] == "close"   # the rest of the body cannot be parsed: the connection ends
    assert "unexpected failure" not in served.log()


def test_bodies_arriving_on_all_connections_together_are_held_to_max_incoming_bytes(fresh_daemon):
    """Connections that each begin a body just under http.max_body_bytes and stall held it each
    until body_timeout_s, past any total (gigabytes from a few hundred connections): once their
    bodies fill limits.max_incoming_bytes, a body that would not fit is 429 OVERLOADED before a
    byte of it is read, and one that fits is still served."""
    daemon = fresh_daemon(http={"listen": f"127.0.0.1:{free_port()}", "max_body_bytes": 65536},
                          limits={"max_incoming_bytes": 200_000})
    host, port = daemon.control("config")["config"]["http"]["listen"].split(":")
    daemon.base_url = f"http://{host}:{port}/v1"
    stalled = [socket.create_connection((host, int(port))) for _ in range(3)]   # 3 x 60,000 bytes held
    for sock in stalled:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n{")

    def refused() -> bool:   # a fourth whole body, sent until the three are seen holding their room
        status, headers, answer = raw(daemon, "POST", "/v1/completions", b" " * 60000)
        return status == 429 and answer["error"]["code"] == "OVERLOADED" and headers["Retry-After"] == "1"
    daemon.wait_until(refused, 30, "a body over max_incoming_bytes refused")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert raw(daemon, "POST", "/v1/completions", body)[0] == 200   # 20,000 bytes left: small bodies fit
    for sock in stalled:
        sock.close()
    daemon.wait_until(lambda: raw(daemon, "POST", "/v1/completions", b" " * 60000)[0] == 400, 30,
                      "the stalled bodies' room given back")


def test_before_the_model_is_loaded_requests_get_503_to_retry_and_are_served_once_it_is(fresh_daemon):
    """While the daemon starts, before its worker has said which model it serves, a request is
    503 UNAVAILABLE with Retry-After, as llama.cpp's server answers while it loads; the openai SDK
    retries those by itself. Before, the model was said not to exist (404) and /v1/models listed
    none. The worker is held (SIGSTOP) as soon as it exists: a start where it had already said
    hello by then is tried again."""
    daemon, worker = held_before_hello(fresh_daemon)
    try:
        for method, path, body in (("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                                   ("POST", "/v1/chat/completions", chat_body())):
            status, headers, answer = raw(daemon, method, path, body)
            assert (status, answer["error"]["code"], headers["Retry-After"]) == (503, "UNAVAILABLE", "1"), path
    finally:
        os.kill(worker, signal.SIGCONT)
    daemon.wait_for_notification("READY=1", 120)
    assert raw(daemon, "POST", "/v1/chat/completions", chat_body())[0] == 200


def held_before_hello(fresh_daemon, tries: int = 5):
    """A starting daemon whose worker is stopped before the scheduler has heard from it."""
    for _ in range(tries):
        daemon = fresh_daemon(started=False, http={"listen": f"127.0.0.1:{free_port()}"})
        daemon.start(wait=False)
        daemon.wait_until(lambda: (daemon.runtime_dir / "control.ipc").exists()
                          and any(p["role"] == "worker" and p["pid"] for p in daemon.processes()), 60, "worker started")
        worker = daemon.pid_of("worker")
        os.kill(worker, signal.SIGSTOP)
        daemon.wait_until(lambda: "serving HTTP" in daemon.log(), 60, "the HTTP listener up")
        daemon.base_url = f"http://{daemon.control('config')['config']['http']['listen']}/v1"
        with daemon.client() as client:
            if not client.status()["workers"]:
                return daemon, worker
        os.kill(worker, signal.SIGCONT)
        daemon.stop()
    raise AssertionError(f"the worker said hello before it could be stopped, {tries} starts in a row")


def test_a_deadline_passed_is_504_and_an_unknown_class_400(served):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    status, _, answer = raw(served, "POST", "/v1/completions", body, {"mcpd-timeout-ms": "1"})
    assert status == 504 and answer["error"]["code"] == "DEADLINE_EXCEEDED"
    status, _, answer = raw(served, "POST", "/v1/completions", body, {"mcpd-priority": "no-such-class"})
    assert status == 400 and "critical" in answer["error"]["message"]
    assert raw(served, "POST", "/v1/completions", body, {"mcpd-timeout-ms": "soon"})[0] == 400


@pytest.mark.parametrize("value", ["1_000", "١٠٠٠".encode(), "+1000", "1000\u00a0".encode(), "0" * 17 + "1000"],
                         ids=["underscore", "arabic-indic", "sign", "nbsp", "21-digits"])
def test_integer_headers_take_ascii_digits_only(served, value):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    assert raw(served, "POST", "/v1/completions", body, {"mcpd-timeout-ms": "1000"})[0] == 200
    context = "/v1/contexts/digits/chat/completions"
    for path, header, sent in (("/v1/completions", "mcpd-timeout-ms", body),
                               (context, "mcpd-context-base", chat_body())):
        status, _, answer = raw(served, "POST", path, sent, {header: value})
        assert (status, answer["error"]["code"], answer["error"]["param"]) == (400, "BAD_REQUEST", header)


@pytest.mark.parametrize("value", [b"00-\xff-01", "00-" + "\u00e9" * 32 + "-" + "0" * 16 + "-01", "x" * 300],
                         ids=["not-utf8", "latin-1", "too-long"])
def test_a_malformed_traceparent_is_ignored_even_of_bytes_that_are_not_utf8(served, value):
    status, _, answer = raw(served, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                            {"traceparent": value})
    assert status == 200, answer


def test_a_client_that_disconnects_cancels_its_request(served):
    host, port = served.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(100).startswith(b"HTTP/1.1 200")   # streaming: it runs
    served.wait_until(lambda: 'code="CANCELLED"' in scrape(served), 60, "the abandoned request cancelled")


def scrape(daemon, wanted: str = 'op="generate"') -> str:
    """The lines of the daemon's Prometheus endpoint that hold `wanted`."""
    url = daemon.status()["metrics"]
    with urllib.request.urlopen(url, timeout=10) as response:
        return "\n".join(line for line in response.read().decode().splitlines() if wanted in line)


def test_curl_reads_the_event_stream(served):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    out = subprocess.run(["curl", "-sN", f"{served.base_url}/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps(chat_body(stream=True))], capture_output=True, text=True, timeout=60).stdout
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_status_shows_the_listener_and_metrics_count_its_requests(served):
    assert raw(served, "POST", "/v1/chat/completions", chat_body())[0] == 200   # its own: run alone, too
    served.wait_until(lambda: served.status()["http"]["responses"].get("200", 0) >= 1 and
                      served.status()["requests"]["latency"].get("generate", {}).get("count", 0) >= 1,
                      30, "the request in the figures")
    status = served.status()
    assert status["http"]["enabled"] and status["http"]["url"] == served.base_url.removesuffix("/v1")
    assert "http: http://" in served.mcpctl("status").stdout
    assert 'mcpd_http_responses_total{status="200"}' in scrape(served, "mcpd_http_responses_total")


def test_a_draining_daemon_answers_503_and_takes_work_again_after_resume(served, sdk):
    assert served.mcpctl("drain").returncode == 0
    try:
        status, _, answer = raw(served, "POST", "/v1/chat/completions", chat_body())
        assert status == 503 and answer["error"]["code"] == "UNAVAILABLE"
    finally:
        assert served.mcpctl("resume").returncode == 0
    assert sdk.chat.completions.create(**chat_body()).usage.completion_tokens == 4


# -- contexts ------------------------------------------------------------------------------------

def test_a_chat_on_a_context_sends_only_new_messages_and_versions_it(served, sdk):
    on_context = openai.OpenAI(base_url=f"{served.base_url}/contexts/chat-1", api_key="unused", max_retries=0)
    first = on_context.chat.completions.with_raw_response.create(**chat_body())
    assert first.headers["mcpd-context-version"] == "1"
    second = on_context.chat.completions.with_raw_response.create(
        **chat_body(messages=[{"role": "user", "content": "more"}]))
    assert second.headers["mcpd-context-version"] == "2"
    # the model saw the history (not resent): the turn's prompt is the context's tokens and the new message
    history = first.parse().usage.total_tokens
    assert second.parse().usage.prompt_tokens > history
    status, headers, shown = raw(served, "GET", "/v1/contexts/chat-1")
    assert status == 200 and shown["version"] == 2 and headers["mcpd-context-version"] == "2"
    with served.client() as zmq_client:   # the same context, seen from ZeroMQ
        assert zmq_client.call("context.open", {"id": "chat-1", "create": False})["version"] == 2


def test_a_stale_base_gets_409_and_the_right_one_passes(served):
    path = "/v1/contexts/chat-2/chat/completions"
    assert raw(served, "POST", path, chat_body())[0] == 200
    status, _, answer = raw(served, "POST", path, chat_body(), {"mcpd-context-base": "0"})
    assert status == 409 and answer["error"]["code"] == "CONFLICT"
    status, headers, _ = raw(served, "POST", path, chat_body(), {"mcpd-context-base": "1"})
    assert status == 200 and headers["mcpd-context-version"] == "2"
    assert raw(served, "POST", "/v1/contexts/absent/chat/completions", chat_body(), {"mcpd-context-base": "3"})[0] == 404


def test_a_streamed_context_turn_reports_its_version_in_the_last_chunk(served):
    on_context = openai.OpenAI(base_url=f"{served.base_url}/contexts/chat-3", api_key="unused", max_retries=0)
    chunks = list(on_context.chat.completions.create(**chat_body(), stream=True))
    assert chunks[-1].model_extra["mcpd_context"] == {"id": "chat-3", "version": 1}


def test_contexts_are_per_tenant_and_can_be_dropped(served):
    path = "/v1/contexts/shared-name/chat/completions"
    assert raw(served, "POST", path, chat_body(), {"mcpd-tenant": "alice"})[0] == 200
    assert raw(served, "GET", "/v1/contexts/shared-name", headers={"mcpd-tenant": "bob"})[0] == 404
    status, _, answer = raw(served, "DELETE", "/v1/contexts/shared-name", headers={"mcpd-tenant": "alice"})
    assert status == 200 and answer["deleted"] is True
    assert raw(served, "GET", "/v1/contexts/shared-name", headers={"mcpd-tenant": "alice"})[0] == 404


# -- API keys ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded(module_daemon):
    daemon = module_daemon(http={"listen": f"127.0.0.1:{free_port()}"}, security={"curve": "on"})   # auth: auto
    daemon.base_url = f"http://{daemon.control('config')['config']['http']['listen']}/v1"
    return daemon


def test_api_keys_are_required_stored_hashed_and_name_the_tenant(guarded):
    assert raw(guarded, "GET", "/v1/models")[0] == 401
    others = guarded.control("keys.list")["api_keys"]   # the module's other tests may have made some
    key = guarded.control("keys.api.add", {"name": "carol"})["api_key"]
    stored = (guarded.root / "state/keys/api/carol.sha256").read_text()
    assert key not in stored and len(stored.strip()) == 64
    assert guarded.control("keys.list")["api_keys"] == sorted([*others, "carol"])
    auth = {"Authorization": f"Bearer {key}"}
    assert raw(guarded, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert raw(guarded, "POST", "/v1/contexts/mine/chat/completions", chat_body(), auth)[0] == 200
    contexts = guarded.control("contexts.list", {"owner": "carol"})["contexts"]
    assert [c["id"] for c in contexts] == ["mine"]
    # the tenant comes from the key: a header cannot claim another
    assert raw(guarded, "GET", "/v1/contexts/mine", headers={**auth, "mcpd-tenant": "mallory"})[0] == 200
    with openai.OpenAI(base_url=guarded.base_url, api_key=key, max_retries=0) as client:
        assert client.chat.completions.create(**chat_body()).usage.completion_tokens == 4


def test_a_revoked_api_key_is_refused(guarded):
    key = guarded.control("keys.api.add", {"name": "dave"})["api_key"]
    auth = {"Authorization": f"Bearer {key}"}
    assert raw(guarded, "GET", "/v1/models", headers=auth)[0] == 200
    assert guarded.mcpctl("keys", "api-revoke", "dave").returncode == 0
    guarded.wait_until(lambda: raw(guarded, "GET", "/v1/models", headers=auth)[0] == 401, 10, "revocation")


@pytest.mark.parametrize("path", ["/v1/models", "/v2"])
def test_a_key_of_bytes_that_are_not_utf8_is_401(guarded, path):
    """aiohttp hands such header bytes on as surrogates, which no key's hash can be taken of: the
    client gets its 401, not a 500 with a traceback in the log for every try."""
    for key in (b"Bearer \xff\xfe", b"Bearer mcpd-\xe9"):
        status, _, answer = raw(guarded, "GET", path, headers={"Authorization": key})
        code = answer["code"] if path == "/v2" else answer["error"]["code"]   # OIP's error body, or OpenAI's
        assert (status, code) == (401, "UNAUTHORIZED"), answer
    assert "unexpected failure" not in guarded.log()


def test_mcpctl_makes_api_keys(guarded):
    made = guarded.mcpctl("keys", "api-add", "erin")
    assert made.returncode == 0 and made.stdout.strip().startswith("mcpd-")
    assert "erin" in guarded.mcpctl("keys", "list").stdout


def test_a_non_loopback_listen_without_keys_refuses_to_start(fresh_daemon):
    daemon = fresh_daemon(started=False, http={"listen": f"0.0.0.0:{free_port()}"})
    daemon.start(wait=False)
    assert daemon.process.wait(120) == 2
    assert "no API key" in daemon.log()


def test_a_rate_limited_request_gets_429_with_retry_after(fresh_daemon):
    daemon = fresh_daemon(started=False, http={"listen": f"127.0.0.1:{free_port()}"},
                          scheduler={"default_class": "metered"})
    with open(daemon.config_path, "a") as config:   # the one class: one request through, the next ~1000 s later
        config.write("[scheduler.classes.metered]\nrank = 9\nrate = 0.001\nburst = 1\n")
    daemon.start()
    daemon.base_url = f"http://{daemon.control('config')['config']['http']['listen']}/v1"
    metered = {"mcpd-priority": "metered"}
    assert raw(daemon, "POST", "/v1/chat/completions", chat_body(), metered)[0] == 200
    status, headers, answer = raw(daemon, "POST", "/v1/chat/completions", chat_body(), metered)
    assert status == 429 and answer["error"]["code"] == "RATE_LIMITED" and answer["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1
    with openai.OpenAI(base_url=daemon.base_url, api_key="unused", max_retries=0,
                       default_headers=metered) as client, pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**chat_body())

"""How the peers benchmark talks to each system: mcpd through its native client (and, as the system
"mcpd-http", through its own OpenAI-compatible listener), the peers through their OpenAI-compatible
HTTP APIs (http.client from the standard library: no dependency the
project lacks). Every request is greedy with EOS ignored; each thread has its own connection.
"""
from __future__ import annotations

import http.client
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass

from mcpd.client import Client

MODEL_NAME = "bench"            # the name both peers serve the model under
REQUEST_TIMEOUT_S = 600


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Streamed:
    first_token_s: float    # from sending the request to the first generated token
    total_s: float          # to the end of the stream
    tokens: int

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / (self.total_s - self.first_token_s)


class McpdTarget:
    """mcpd through its native client: one Client per thread (a ZeroMQ socket is not thread-safe)."""
    name = "mcpd"

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.local = threading.local()
        self.chats = itertools.count()

    def client(self) -> Client:
        if not hasattr(self.local, "client"):
            self.local.client = Client(self.endpoint, timeout=REQUEST_TIMEOUT_S, tenant="bench")
        return self.local.client

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        result = self.client().generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return Completion(result.text, result.prompt_tokens, result.completion_tokens)

    def stream(self, prompt: str, max_tokens: int) -> Streamed:
        started = time.perf_counter()
        first, tokens = None, 0
        for chunk in self.client().generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                            stream=True):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - started
            tokens += len(chunk.token_ids)
        return Streamed(first, time.perf_counter() - started, tokens)

    def chat_last_turn_ttft(self, turns: list[str], max_tokens: int) -> tuple[float, int]:
        """Turns 1..n-1 on a context (each prefills only its own message), then turn n streamed;
        returns its first-token seconds and the tokens the model saw before its reply."""
        chat = self.client().context(f"chat-{os.getpid()}-{next(self.chats)}")
        params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        for text in turns[:-1]:
            chat.chat("user", text, **params)
        started = time.perf_counter()
        stream = self.client().generate(messages=[{"role": "user", "content": turns[-1]}], context=chat.id,
                                        base=chat.version, stream=True, **params)
        first = None
        for chunk in stream:
            if chunk.token_ids and first is None:
                first = time.perf_counter() - started
        chat.drop()
        return first, stream.result.prompt_tokens   # the context's history and this turn


class HttpTarget:
    """A peer through its OpenAI-compatible API: one keep-alive connection per thread."""

    def __init__(self, name: str, port: int):
        self.name, self.port = name, port
        self.local = threading.local()
        # vLLM takes ignore_eos; llama-cpp-python does not, but suppresses EOS until min_tokens.
        self.no_eos = (lambda n: {"ignore_eos": True}) if name == "vllm" else (lambda n: {"min_tokens": n})

    def complete(self, prompt: str, max_tokens: int) -> Completion:
        reply = self._post("/v1/completions", self._body(prompt=prompt, max_tokens=max_tokens))
        usage = reply["usage"]
        return Completion(reply["choices"][0]["text"], usage["prompt_tokens"], usage["completion_tokens"])

    def stream(self, prompt: str, max_tokens: int) -> Streamed:
        started = time.perf_counter()
        events = self._post_stream("/v1/completions", self._body(prompt=prompt, max_tokens=max_tokens, stream=True))
        first = next(events) - started
        for _ in events:
            pass
        # max_tokens with EOS ignored: checked against usage in the warm-up.
        return Streamed(first, time.perf_counter() - started, max_tokens)

    def chat_last_turn_ttft(self, turns: list[str], max_tokens: int) -> tuple[float, int]:
        """The stateless way: every turn sends the whole history, the server's replies included."""
        messages = []
        for text in turns[:-1]:
            messages.append({"role": "user", "content": text})
            reply = self._post("/v1/chat/completions", self._body(messages=messages, max_tokens=max_tokens))
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        messages.append({"role": "user", "content": turns[-1]})
        started = time.perf_counter()
        events = self._post_stream("/v1/chat/completions", self._body(messages=messages, max_tokens=max_tokens,
                                                                      stream=True, stream_options={"include_usage": True}))
        first = next(events) - started
        for _ in events:
            pass
        return first, self.local.last_usage.get("prompt_tokens", 0)

    def _body(self, **fields) -> dict:
        return {"model": MODEL_NAME, "temperature": 0, **self.no_eos(fields["max_tokens"]), **fields}

    def _connection(self) -> http.client.HTTPConnection:
        if not hasattr(self.local, "connection"):
            self.local.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        return self.local.connection

    def _send(self, path: str, body: dict) -> http.client.HTTPResponse:
        payload = json.dumps(body).encode()
        for attempt in (1, 2):   # a keep-alive connection the server closed: reconnect once
            connection = self._connection()
            try:
                connection.request("POST", path, payload, {"Content-Type": "application/json"})
                response = connection.getresponse()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                connection.close()
                del self.local.connection
                if attempt == 2:
                    raise
        if response.status != 200:
            raise RuntimeError(f"{self.name} {path}: HTTP {response.status}: {response.read()[:300]!r}")
        return response

    def _post(self, path: str, body: dict) -> dict:
        return json.loads(self._send(path, body).read())

    def _post_stream(self, path: str, body: dict):
        """Yields the arrival time of each server-sent event that carries a choice; keeps usage."""
        response = self._send(path, body)
        self.local.last_usage = {}
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                self.local.last_usage = event["usage"]
            if event.get("choices"):
                yield time.perf_counter()


class McpdHttpTarget(HttpTarget):
    """mcpd through its OpenAI-compatible listener: the peers' requests, but a chat on a
    daemon-side context (/v1/contexts/{id}/chat/completions) sending only each turn's message."""

    def __init__(self, port: int):
        super().__init__("mcpd-http", port)
        self.no_eos = lambda n: {"ignore_eos": True}
        self.chats = itertools.count()

    def chat_last_turn_ttft(self, turns: list[str], max_tokens: int) -> tuple[float, int]:
        path = f"/v1/contexts/chat-{os.getpid()}-{next(self.chats)}/chat/completions"
        for text in turns[:-1]:
            self._post(path, self._body(messages=[{"role": "user", "content": text}], max_tokens=max_tokens))
        started = time.perf_counter()
        events = self._post_stream(path, self._body(messages=[{"role": "user", "content": turns[-1]}],
                                                    max_tokens=max_tokens, stream=True,
                                                    stream_options={"include_usage": True}))
        first = next(events) - started
        for _ in events:
            pass
        return first, self.local.last_usage.get("prompt_tokens", 0)

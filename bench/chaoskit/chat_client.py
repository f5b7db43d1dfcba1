"""A cluster-aware chat client: it sends each turn of its contexts to the node `route` picks,
retries what may pass later (UNAVAILABLE, CONFLICT, OVERLOADED, a node whose connection dropped)
with a bounded backoff, and keeps every turn it was answered, with when.

Each context has this one client as its only writer and every turn names its base version, so a
turn whose answer was lost with its node is found on a retry: the context is then one version
past the client's, with this turn's tokens (`recovered`, not acknowledged).
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from chaoskit.cluster_view import ClusterView, route
from mcpd.client import Client
from mcpd.client.replies import generate_args, generate_result, result_of
from mcpd.protocol import codes
from mcpd.protocol import delta
from mcpd.protocol.delta import DeltaLimits
from mcpd.protocol.codes import MCPDError

TENANT = "chaos"
TOKENS = "tokens"
TURN = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
RETRYABLE = {codes.UNAVAILABLE, codes.CONFLICT, codes.OVERLOADED}
BACKOFF_S = (0.02, 0.5)        # the first retry's wait, and the most any wait grows to
HISTORY_CAP = 3000             # tokens a context may reach, with room for a turn within max_model_len (4096)
GIVE_UP_S = 60.0               # a turn unanswered this long counts as unanswered
POLL_S = 0.02                  # how often a wait for a reply looks at the node's connection
SAME, MOVED = "same", "moved"


class NodeLost(Exception):
    """The node's connection dropped, or it did not answer in GIVE_UP_S: the turn's fate is unknown."""


@dataclass
class Turn:
    version: int
    prompt: str
    tokens: list[int]     # appended_token_ids: the prompt's tokens and the answer's
    started: float
    answered: float
    acked: bool           # False: committed, but its answer was lost with a node (found on a retry)
    node: str             # the node that answered it (or, for one not acknowledged, found it)


@dataclass
class ChatContext:
    id: str
    version: int = 0
    tokens: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    unanswered: int = 0
    full: bool = False         # its history reached HISTORY_CAP: no more turns
    retries: int = 0
    refusals: dict[str, int] = field(default_factory=dict)   # final refusals (not retryable), by code


class ChatClient:
    def __init__(self, view: ClusterView, context_ids: list[str]):
        self.view = view
        self.contexts = [ChatContext(cid) for cid in context_ids]
        self.connections: dict[str, Client] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._chat, daemon=True)

    def open_all(self) -> None:
        for context in self.contexts:
            self._with_retries(context, lambda node, ctx=context: self._open(node, ctx), time.monotonic(), None)

    def start(self) -> "ChatClient":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(GIVE_UP_S + 30)

    def close(self) -> None:
        for connection in self.connections.values():
            connection.close()

    def _chat(self) -> None:
        n = 0
        while not self.stopping.is_set():
            context = self.contexts[n % len(self.contexts)]
            n += 1
            if len(context.tokens) > HISTORY_CAP:
                context.full = True
                if all(c.full for c in self.contexts):
                    return
                continue
            self.turn(context, f" Q{len(context.turns)}.")   # short: the embedded model reads bytes

    def turn(self, context: ChatContext, prompt: str) -> None:
        started = time.monotonic()
        if not self._with_retries(context, lambda node: self._turn(node, context, prompt, started), started, prompt):
            context.unanswered += 1

    def _with_retries(self, context: ChatContext, attempt, started: float, prompt: str | None) -> bool:
        """attempt(node) until it is answered; False when GIVE_UP_S passed first. With the turn's
        `prompt`, an attempt of unknown fate is looked for in the context before the next (_reconcile)."""
        wait, unknown = BACKOFF_S[0], False
        while time.monotonic() - started < GIVE_UP_S:
            node = route(self.view, TENANT, context.id)
            try:
                if node is not None:
                    if unknown and prompt is not None and self._reconcile(node, context, prompt, started) == MOVED:
                        return True
                    attempt(node)
                    return True
            except NodeLost:
                self._drop(node)
                unknown = True
            except MCPDError as e:
                if e.code not in RETRYABLE:
                    context.refusals[e.code] = context.refusals.get(e.code, 0) + 1
                    return True
                unknown = True
            context.retries += 1
            time.sleep(wait * random.uniform(0.5, 1.0))
            wait = min(wait * 2, BACKOFF_S[1])
        return False

    def read(self, context: ChatContext) -> tuple[int, list[int]]:
        """The context's version and whole history as its node has them now, once it caught up
        with the version this client knows (a node behind takes the newer copy then)."""
        node = route(self.view, TENANT, context.id)
        self._read(node, context, context.version)
        return self._read(node, context, 0)

    def _read(self, node: str, context: ChatContext, since: int) -> tuple[int, list[int]]:
        """The context's version on `node` and its tokens (this client's first `since` versions' and what the node adds)."""
        result, frames = self._call(node, "context.get", {"id": context.id, "since": since}, with_frames=True)
        tokens = np.asarray(context.tokens if since else [], np.int32)
        for change in delta.from_wire(result["changes"], frames, DeltaLimits()):
            if change.name == TOKENS:
                tokens = delta.apply(tokens, change, DeltaLimits())
        return result["version"], [int(t) for t in tokens]

    def _open(self, node: str, context: ChatContext) -> None:
        self._call(node, "context.open", {"id": context.id, "create": True})

    def _turn(self, node: str, context: ChatContext, prompt: str, started: float) -> None:
        args = generate_args(prompt, None, None, False, {**TURN, "context": context.id, "base": context.version})
        turn = generate_result(self._call(node, "generate", args)).context
        context.turns.append(Turn(turn.version, prompt, list(turn.appended_token_ids), started,
                                  time.monotonic(), acked=True, node=node))
        context.tokens = context.tokens + list(turn.appended_token_ids)
        context.version = turn.version

    def _reconcile(self, node: str, context: ChatContext, prompt: str, started: float) -> str:
        """After an attempt of unknown fate, where the context is on `node`: SAME (send the turn), or
        MOVED (the turn committed without its answer: adopted, not acknowledged)."""
        version, tokens = self._read(node, context, context.version)
        if version == context.version:
            return SAME
        context.turns.append(Turn(version, prompt, tokens[len(context.tokens):], started, time.monotonic(),
                                  acked=False, node=node))
        context.tokens, context.version = tokens, version
        return MOVED

    def _call(self, node: str, op: str, args: dict, with_frames: bool = False):
        """One request to `node`, its answer; NodeLost when the node's connection drops first."""
        client = self._connection(node)
        request_id = client.send(op, args)
        deadline = time.monotonic() + GIVE_UP_S
        # The client's own wait cannot look at the node's connection meanwhile: poll its socket
        # (one request in flight on it at a time), and read the answer once one is there.
        while not client._socket.poll(POLL_S * 1000):
            if node in self.view.down or time.monotonic() > deadline:
                raise NodeLost(node)
        header, frames = client._receive(request_id, GIVE_UP_S)
        result = result_of(header)
        return (result, frames) if with_frames else result

    def _connection(self, node: str) -> Client:
        if node not in self.connections:
            self.connections[node] = Client(self.view.endpoints[node], timeout=GIVE_UP_S, tenant=TENANT)
        return self.connections[node]

    def _drop(self, node: str) -> None:
        """Forget the connection: requests still queued in it must not reach the node when it is back."""
        connection = self.connections.pop(node, None)
        if connection is not None:
            connection.close()


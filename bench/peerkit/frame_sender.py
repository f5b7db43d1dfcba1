"""The cheapest sender of mcpd `infer` requests this bench has, for the open loops one process
must offer on time (a burst at twice a fast server's capacity): every request's frames are built
before the run (a header per input and priority with its id left as four bytes to patch, the
payload frames per input), one raw DEALER socket sends with NOBLOCK and reads replies in batches,
and a run keeps only arrays (when each request went out, when its reply came, its outcome). A
reply is stamped as the socket yields it, before any is decoded, and a wait for the next send
wakes for a reply: the sender's own work delays no reply's stamp.

A reply counts as ok only when it is a real result: kind "ok" with outputs that describe its
payload frames (the client's own check, infer.result). Ids grow across runs, so a late reply to
an earlier run's request is never taken for this run's."""
from __future__ import annotations

import random
import select
import struct
import time

import msgpack
import numpy as np
import zmq

from mcpd.client import infer
from mcpd.protocol import wire
from mcpd.protocol.codes import MCPDError

ID_MARK = 0xFFFF_FFFF               # msgpack writes it as 0xce and four bytes: the id's place in a template
ID_BYTES = struct.Struct(">I")
PRIORITIES = ("normal", "high", "low")
UNANSWERED, OK, BAD_RESULT = 0, 1, 2   # outcome codes; an error reply's code is added to `codes` as seen
DRAIN_BATCH = 256                   # replies read per turn before the schedule is looked at again
SEND_HWM = 1 << 20                  # no send waits on ZeroMQ's queue: a late send is the generator's lag
LAST_REPLIES_POLL_MS = 10           # everything sent: how long one wait for the last replies is


class FrameSender:
    """`infer` of `model` at `endpoint` on one DEALER socket; input i's frames from `inputs`."""

    def __init__(self, endpoint: str, model: str, inputs, deadline_ms: int, cache: bool = True, first_id: int = 0,
                 tenant: str | None = None):
        self.endpoint, self.model, self.inputs, self.deadline_ms, self.cache = endpoint, model, inputs, deadline_ms, cache
        self.tenant = tenant   # the header's (None: left out, the daemon's default)
        self.templates: list[list[tuple[bytes, bytes]]] = []   # [input][priority] -> (before id, after id)
        self.payloads: list[list[bytes]] = []
        self.codes = ["unanswered", "ok", "bad result"]
        self.next_id = first_id
        self.socket = None

    def prepare(self, count: int) -> None:
        """Build the frames of inputs 0..count-1 now, before anything is timed."""
        for index in range(len(self.templates), count):
            described, frames = self.inputs.frames(index)
            args = {"model": self.model, "cache": self.cache, "inputs": described}
            self.templates.append([_template(args, priority, self.deadline_ms, self.tenant) for priority in PRIORITIES])
            self.payloads.append(frames)

    def connect(self) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self.socket.setsockopt(zmq.RCVHWM, SEND_HWM)
        self.socket.connect(self.endpoint)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()
            self.socket = None

    def open_loop(self, at: np.ndarray, index: np.ndarray, priority: np.ndarray, start: float,
                  timeout_s: float) -> dict:
        """Arrival k (input index[k], priority code priority[k]) sent at `start` + at[k]; waits
        for every reply, or `timeout_s` past the last send. Arrays back: sent and replied
        (monotonic seconds; NaN when no reply came), outcome codes (`codes` names them), cached,
        the first arrival's id (arrival k's is that + k); and the CPU seconds this process spent on the run."""
        count = len(at)
        base, self.next_id = self.next_id, self.next_id + count
        run = _Run(count, base)
        cpu = time.process_time()
        due = start + at
        sent = 0
        while sent < count or (run.waiting and time.monotonic() < run.sent[sent - 1] + timeout_s):
            sent = self._send_due(due, index, priority, base, sent, run)
            self._drain(run)
            if sent < count:
                _wait(self.socket, due[sent] - time.monotonic())
            elif run.waiting:
                self.socket.poll(LAST_REPLIES_POLL_MS, zmq.POLLIN)
        return {"sent": run.sent, "replied": run.replied, "outcome": run.outcome, "cached": run.cached,
                "codes": list(self.codes), "first_id": base, "cpu_s": time.process_time() - cpu}

    def closed_loop(self, clients: int, seconds: float, pick, seed: int, timeout_s: float) -> float:
        """Requests/s answered ok within `seconds`: `clients` requests always in flight, each
        reply followed by the next request, inputs drawn by `pick(rng)`."""
        rng = random.Random(seed)
        deadline = time.monotonic() + seconds
        base = self.next_id
        for _ in range(clients):
            self._send_one(pick(rng), 0, self._new_id())
        in_flight, ok = clients, 0
        while in_flight and self.socket.poll(timeout_s * 1e3, zmq.POLLIN):
            for _, header, payload in self._received():
                reply = msgpack.unpackb(header)
                if not (type(reply.get("id")) is int and reply["id"] >= base):
                    continue   # an earlier run's late reply
                in_flight -= 1
                if time.monotonic() > deadline:
                    continue
                ok += self._outcome(reply, payload) == OK
                self._send_one(pick(rng), 0, self._new_id())
                in_flight += 1
        return ok / seconds

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _send_due(self, due: np.ndarray, index: np.ndarray, priority: np.ndarray, base: int, sent: int,
                  run: "_Run") -> int:
        """Sends every arrival due by now from `sent` on; the count sent so far."""
        now = time.monotonic()
        while sent < len(due) and due[sent] <= now:
            try:
                self._send_one(int(index[sent]), int(priority[sent]), base + sent)
            except zmq.Again:   # ZeroMQ's queue is full: the rest go when it drains, late
                break
            now = run.sent[sent] = time.monotonic()
            sent += 1
        return sent

    def _send_one(self, index: int, priority: int, request_id: int) -> None:
        before, after = self.templates[index][priority]
        self.socket.send(before + ID_BYTES.pack(request_id) + after, zmq.SNDMORE | zmq.NOBLOCK)
        self.socket.send_multipart(self.payloads[index], zmq.NOBLOCK)

    def _drain(self, run: "_Run") -> None:
        for stamp, header, payload in self._received():
            reply = msgpack.unpackb(header)
            run.record(reply.get("id"), self._outcome(reply, payload), stamp, reply)

    def _received(self) -> list[tuple[float, bytes, list[bytes]]]:
        """(when it was read, header, payload frames) of each reply waiting now, DRAIN_BATCH at
        most, all read before any is decoded."""
        received = []
        for _ in range(DRAIN_BATCH):
            try:
                header, *payload = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            received.append((time.monotonic(), header, payload))
        return received

    def _outcome(self, reply: dict, payload: list[bytes]) -> int:
        if reply.get("kind") != "ok":
            code = str(reply.get("code"))
            if code not in self.codes:
                self.codes.append(code)
            return self.codes.index(code)
        try:
            infer.result(reply["result"], payload)
        except (MCPDError, KeyError, TypeError, ValueError):
            return BAD_RESULT
        return OK


class _Run:
    """One open loop's arrays; arrival k's id is base + k."""

    def __init__(self, count: int, base: int):
        self.base = base
        self.sent = np.full(count, np.nan)
        self.replied = np.full(count, np.nan)
        self.outcome = np.zeros(count, np.int16)
        self.cached = np.zeros(count, bool)
        self.waiting = count

    def record(self, request_id, outcome: int, now: float, reply: dict) -> None:
        arrival = request_id - self.base if type(request_id) is int else -1
        if not 0 <= arrival < len(self.outcome) or self.outcome[arrival] != UNANSWERED:
            return   # an earlier run's late reply, or a second reply to one request
        self.replied[arrival], self.outcome[arrival] = now, outcome
        self.cached[arrival] = outcome == OK and bool(reply["result"].get("cached"))
        self.waiting -= 1


def _template(args: dict, priority: str, deadline_ms: int, tenant: str | None) -> tuple[bytes, bytes]:
    """A request's header split around its id's four bytes."""
    fields = {"tenant": tenant} if tenant is not None else {}
    header = wire.encode_request("infer", ID_MARK, args, priority=priority, timeout_ms=deadline_ms, **fields)
    before, mark, after = header.partition(b"\xce" + ID_BYTES.pack(ID_MARK))
    if not mark or ID_BYTES.pack(ID_MARK) in after:
        raise ValueError("the id's place in a request header is not unique")
    return before + b"\xce", after


def _wait(socket, seconds: float) -> None:
    """Until the next arrival is due or a reply comes, whichever is first: on the socket's
    descriptor (zmq's poll counts whole ms, and a sleep would not wake for a reply). The
    descriptor is edge-triggered; reading EVENTS first re-arms it, so no reply slips between."""
    if seconds > 0 and not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        select.select([socket.getsockopt(zmq.FD)], [], [], seconds)

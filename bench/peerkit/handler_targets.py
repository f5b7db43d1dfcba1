"""What bench/handlers.py sends and how: a model's inputs, numbered and made from their number
(the same input every time, for every server), and the targets that send input i: mcpd's `infer`
over ZeroMQ with raw payload frames, and any server of the Open Inference Protocol's JSON over
HTTP (mcpd's KServe route, LitServe, MLServer). Every encoding is made once per input, before it
is timed."""
from __future__ import annotations

import asyncio
import itertools

import aiohttp
import msgpack
import numpy as np
import zmq
import zmq.asyncio

from mcpd.client import infer
from mcpd.handlers.tensors import TensorSpec
from mcpd.protocol import wire
from peerkit import v2_json

DEADLINE_MS = 10_000
WORDS = ("card payment refund account transfer limit fraud branch loan statement charge online mobile "
         "blocked declined balance interest fee overdraft mortgage savings deposit withdraw atm").split()
TEXT_WORDS = (4, 24)      # a text input's words (~15-75 tokens), drawn per input
VARIABLE_LENGTH = (8, 64)  # a variable non-batch dim's size, drawn per input


class TensorInputs:
    """Input i of a model with these declared inputs: one row, drawn from a generator seeded by i."""

    def __init__(self, specs: dict[str, TensorSpec], seed: int = 0):
        self.specs, self.seed = specs, seed
        self._frames: dict[int, tuple[list, list[bytes]]] = {}
        self._bodies: dict[int, bytes] = {}

    def arrays(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng((self.seed, index))
        return {name: draw(spec, rng) for name, spec in self.specs.items()}

    def frames(self, index: int) -> tuple[list, list[bytes]]:
        """The `infer` args' inputs and their payload frames, as mcpd's client encodes them."""
        if index not in self._frames:
            args, frames = infer.request(None, self.arrays(index), {})
            self._frames[index] = args["inputs"], frames
        return self._frames[index]

    def json_body(self, index: int) -> bytes:
        if index not in self._bodies:
            self._bodies[index] = v2_json.request_body(self.arrays(index))
        return self._bodies[index]


def draw(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    if spec.datatype == "BYTES":
        words = rng.choice(WORDS, size=rng.integers(*TEXT_WORDS))
        text = np.empty(1, dtype=object)
        text[0] = " ".join(words).encode()
        return text.reshape((1,) * len(spec.shape))
    shape = [1] + [int(rng.integers(*VARIABLE_LENGTH)) if d == -1 else d for d in spec.shape[1:]]
    dtype = v2_json.DATATYPES[spec.datatype]
    if spec.datatype.startswith("FP"):
        return rng.standard_normal(shape).astype(dtype)
    if spec.datatype == "BOOL":
        return rng.random(shape) < 0.5
    return rng.integers(0, 100, shape).astype(dtype)


class McpdZmq:
    """mcpd's `infer` on one DEALER socket, many requests in flight; `extra`: more of infer's
    args (a context to read inputs from, say). Counts the bytes it sends."""

    def __init__(self, name: str, endpoint: str, model: str, inputs: TensorInputs, cache: bool = True,
                 extra: dict | None = None):
        self.name, self.endpoint, self.model, self.inputs = name, endpoint, model, inputs
        self.args = {"model": model, "cache": cache, **(extra or {})}
        self.socket = None
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {}
        self.sent_bytes = 0

    def prepare(self, count: int) -> None:
        """Encode inputs 0..count-1 now, before anything is timed."""
        for index in range(count):
            self.inputs.frames(index)

    async def infer(self, index: int, priority: str) -> tuple[str, bool]:
        reply, _ = await self._call(index, priority=priority, timeout_ms=DEADLINE_MS)
        if reply["kind"] == "ok":
            return "ok", bool(reply["result"].get("cached"))
        return reply["code"], False

    async def outputs(self, index: int) -> dict[str, np.ndarray]:
        """Input i's outputs as the daemon answers them (the check that every server computes alike)."""
        reply, payload = await self._call(index)
        if reply["kind"] != "ok":
            raise RuntimeError(f"{self.name}: {reply['code']}: {reply['message']}")
        return infer.result(reply["result"], payload).outputs

    async def _call(self, index: int, **header_fields) -> tuple[dict, list[bytes]]:
        if self.socket is None:
            self._connect()
        request_id = next(self.ids)
        future = self.waiting[request_id] = asyncio.get_running_loop().create_future()
        inputs, frames = self.inputs.frames(index)
        message = [wire.encode_request("infer", request_id, {**self.args, "inputs": inputs}, **header_fields), *frames]
        self.sent_bytes += sum(map(len, message))
        await self.socket.send_multipart(message)
        return await future

    def _connect(self) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(self.endpoint)
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            header, *payload = await self.socket.recv_multipart()
            reply = msgpack.unpackb(header, raw=False)
            future = self.waiting.pop(reply["id"], None)
            if future is not None and not future.done():
                future.set_result((reply, payload))

    async def close(self) -> None:
        if self.socket is not None:
            self.reader.cancel()
            self.socket.close()
            self.socket = None


class HttpV2:
    """An Open Inference Protocol JSON body POSTed to `path`, keep-alive connections."""

    def __init__(self, name: str, port: int, path: str, inputs: TensorInputs, connections: int = 256):
        self.name, self.url, self.inputs, self.connections = name, f"http://127.0.0.1:{port}{path}", inputs, connections
        self.session = None

    def prepare(self, count: int) -> None:
        """Encode inputs 0..count-1 now, before anything is timed."""
        for index in range(count):
            self.inputs.json_body(index)

    async def infer(self, index: int, priority: str) -> tuple[str, bool]:
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections))
        body = self.inputs.json_body(index)
        try:
            async with self.session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as response:
                await response.read()
                return ("ok" if response.status == 200 else f"HTTP {response.status}"), False
        except aiohttp.ClientError as e:   # the server closed or reset the connection: that request failed
            return type(e).__name__, False

    async def outputs(self, index: int) -> dict[str, np.ndarray]:
        """Input i's outputs as this server answers them (the check that every server computes alike)."""
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.connections))
        async with self.session.post(self.url, data=self.inputs.json_body(index),
                                     headers={"Content-Type": "application/json"}) as response:
            body = await response.json(content_type=None)
        if response.status != 200:
            raise RuntimeError(f"{self.name}: HTTP {response.status}: {str(body)[:300]}")
        return {t["name"]: v2_json.array(t) for t in body["outputs"]}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

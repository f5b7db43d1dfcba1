"""An infer request and its reply as both clients build and read them: named numpy arrays to
input headers and frames, and the reply's output headers and frames back to arrays. Loaded
only by an infer (it needs numpy, which the rest of the client does not)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mcpd.handlers import tensors
from mcpd.handlers.tensor_header import TensorHeader
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError


@dataclass(frozen=True)
class InferResult:
    outputs: dict[str, np.ndarray]
    model: str
    version: str       # the version that answered (a split's pick, or the fast rung's)
    cached: bool       # served from the model's result cache
    context_version: int | None = None


def request(model: str | None, inputs: dict[str, np.ndarray], args: dict) -> tuple[dict, list[bytes]]:
    """(the infer's args, its payload frames); `args`: infer's other arguments (nil ones left out)."""
    headers, frames = [], []
    for name, array in inputs.items():
        header, frame = tensors.encode(name, np.asarray(array))
        headers.append(header.describe())
        frames.append(frame)
    given = {k: v for k, v in args.items() if v is not None}
    return {**given, **({"model": model} if model else {}), "inputs": headers}, frames


def result(reply: dict, frames: list[bytes]) -> InferResult:
    """The reply's outputs as arrays; INTERNAL when the daemon's reply does not describe its frames."""
    described = reply.get("outputs")
    if not isinstance(described, list) or len(described) != len(frames):
        raise MCPDError(codes.INTERNAL, f"an infer reply describes {described!r} for {len(frames)} frame(s)")
    outputs = {}
    for item, frame in zip(described, frames):
        header = TensorHeader(item["name"], item["datatype"], tuple(item["shape"]))
        outputs[header.name] = tensors.decode(header, frame)
    return InferResult(outputs, reply.get("model", ""), reply.get("version", ""), bool(reply.get("cached")),
                       reply.get("context_version"))

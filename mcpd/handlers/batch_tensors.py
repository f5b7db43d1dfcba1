"""A batch's tensors from its requests' and back: the requests' rows concatenated on dim 0, a
dim that differs between them padded with zeros to the longest (with "<name>.lengths" beside
it), and each output's rows split back per request."""
from __future__ import annotations

import numpy as np

from mcpd.handlers.tensors import VARIABLE, TensorSpec
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError


def is_variable(name: str, array: np.ndarray, specs: dict[str, TensorSpec]) -> bool:
    """Whether an input's dim 1 may differ between requests: declared so, or made by preprocess
    (not declared at all) with more than one dim."""
    spec = specs.get(name)
    if spec is None:
        return array.ndim >= 2
    return any(dim == VARIABLE for dim in spec.shape[1:])


def length_of(inputs: dict[str, np.ndarray], specs: dict[str, TensorSpec]) -> int:
    """A request's length for the batcher's bins: its longest variable dim 1 (0: none varies)."""
    return max((a.shape[1] for name, a in inputs.items() if a.ndim >= 2 and is_variable(name, a, specs)), default=0)


def assemble(requests: list[dict[str, np.ndarray]], specs: dict[str, TensorSpec]) -> tuple[dict[str, np.ndarray], int, int]:
    """(the batch, padded elements, all elements of the padded inputs)."""
    batch, padded, total = {}, 0, 0
    for name, first in requests[0].items():
        parts = [inputs[name] for inputs in requests]
        if first.ndim < 2 or not is_variable(name, first, specs):
            batch[name] = np.concatenate(parts)   # a copy even of one: predict gets writable arrays
            continue
        batch[name], batch[f"{name}.lengths"], pad = _padded(parts)
        padded += pad
        total += batch[name].size
    return batch, padded, total


def _padded(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    shape = tuple(max(p.shape[d] for p in parts) for d in range(1, parts[0].ndim))
    rows = sum(p.shape[0] for p in parts)
    out = np.full((rows, *shape), b"" if parts[0].dtype == object else 0, parts[0].dtype)
    lengths, at = np.empty(rows, np.int64), 0
    for part in parts:
        out[(slice(at, at + part.shape[0]), *(slice(0, d) for d in part.shape[1:]))] = part
        lengths[at:at + part.shape[0]] = part.shape[1]
        at += part.shape[0]
    return out, lengths, out.size - sum(p.size for p in parts)


def split(outputs, rows: list[int]) -> list[dict[str, np.ndarray]]:
    """Each request's rows of the outputs; INTERNAL when the handler broke its contract."""
    if not isinstance(outputs, dict) or not all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in outputs.values()):
        raise MCPDError(codes.INTERNAL, "handler's predict must return a dict of numpy arrays with a batch dim")
    total = sum(rows)
    for name, array in outputs.items():
        if array.shape[0] != total:
            raise MCPDError(codes.INTERNAL, f"handler returned {array.shape[0]} rows for {total} "
                                            f"(output {name!r})")
    bounds = np.cumsum([0, *rows])
    return [{name: array[start:end] for name, array in outputs.items()} for start, end in zip(bounds, bounds[1:])]

"""A model's parameters in a region of the shared device pool (resident: never evicted), so a
worker restarted after a crash takes them from the pool instead of reading the checkpoint again.

    weights region: | header (magic, complete) | each parameter's bytes, 64-byte aligned, in
                                                   named_parameters() order |

The layout follows from the model's architecture alone (names, shapes, dtypes), which a loader
knows before it reads any weights: so the successor builds the model's skeleton, finds the
region under the same key (region_key: the model's files, dtype and this layout) and, if its
`complete` flag is set, points every parameter at its bytes in the pool. The first worker loads
from disk as always, copies each parameter into the region, points the parameter there (the
private copy is freed: the weights are in memory once), and sets `complete` last; one killed
mid-copy leaves it clear, and its successor loads from disk again.

Loaders call attach() before reading weights and keep() after; the model sees no difference.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mcpd.config import ModelConfig
from mcpd.engine.kv_records import region_key
from mcpd.memory.pool_segment import WEIGHTS, PoolSegment

MAGIC = 0x737468676965776D   # "mweights"
HEADER = np.dtype([("magic", "<u8"), ("complete", "<u8")])
ALIGN = 64


class ResidentWeights:
    def __init__(self, segment: PoolSegment, owner: int, model: ModelConfig):
        self.segment, self.owner, self.model_config = segment, owner, model
        self.reused = False      # the region is a predecessor's
        self.from_pool = False   # the parameters are a predecessor's: no weight was read

    def attach(self, model: nn.Module, name: str) -> bool:
        """Point model's parameters at a predecessor's complete region; False if there is none
        (the caller loads the weights, then calls keep)."""
        memory = self._region(model, name)
        if not (self.reused and self.head["magic"][0] == MAGIC and self.head["complete"][0] == 1):
            self.head[0] = (MAGIC, 0)
            return False
        self._point(model, memory)
        self.from_pool = True
        return True

    def keep(self, model: nn.Module) -> None:
        """Copy the loaded parameters into the region and point the model at them."""
        memory = self.memory
        for (_, param), (offset, nbytes) in zip(_unique_parameters(model), self.places):
            memory[offset:offset + nbytes].view(param.dtype).view(param.shape).copy_(param.detach())
        self._point(model, memory)
        self.head["complete"] = 1   # last: every byte is in place

    def _region(self, model: nn.Module, name: str) -> torch.Tensor:
        params = _unique_parameters(model)
        self.places, at = [], HEADER.itemsize
        for _, param in params:
            at = -(-at // ALIGN) * ALIGN
            self.places.append((at, param.numel() * param.element_size()))
            at += self.places[-1][1]
        layout = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in params)
        key = region_key(self.model_config, name, ("weights", layout))
        region = self.segment.take(WEIGHTS, self.owner, key, at)
        self.reused = region.reused
        buffer = self.segment.buffer(region)
        self.head = np.frombuffer(buffer, HEADER, 1)
        self.memory = torch.frombuffer(buffer, dtype=torch.uint8)
        return self.memory

    def _point(self, model: nn.Module, memory: torch.Tensor) -> None:
        """Replace each parameter by one over its bytes in the pool (tied slots stay tied)."""
        pooled = {}
        for (_, param), (offset, nbytes) in zip(_unique_parameters(model), self.places):
            view = memory[offset:offset + nbytes].view(param.dtype).view(param.shape)
            pooled[id(param)] = nn.Parameter(view, requires_grad=False)
        for module in model.modules():
            for slot, param in module._parameters.items():
                if param is not None:
                    module._parameters[slot] = pooled[id(param)]


def _unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(model.named_parameters())   # each shared parameter once, in a fixed order

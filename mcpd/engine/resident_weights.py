"""A model's weights in a region of the shared device pool (resident: never evicted), in the form
its kernels read them (kernels/forms.py: the native kernels' packed panels, the torch
kernels' plain matrices), so a worker restarted after a crash runs on them at once: it reads no
checkpoint and packs nothing, and the weights are in memory once, in the pool.

    weights region: | record: int64 magic, complete; holds | each form's tensors' bytes, 64-byte
                                                              aligned, in kernel_forms() order |

The layout follows from the model's architecture and the chosen kernels alone (the forms'
shapes, computed on the meta device), which a loader knows before it reads any weight: so the
successor builds the model's skeleton, chooses its kernels, asks for the region under the same
key (region_key over the model's files, dtype, the kernels' form and this layout) and, if the
record says the region holds exactly that and is complete, runs on views of it.

The record is the region's validity record, as the KV blocks have theirs (kv_records.py): the
first worker clears `complete` before it writes a byte, loads from disk as always, prepares and
copies each form into its place (one prepared copy at a time), points the model at the pool
and writes `holds` (the key: which model, dtype and kernel layout the bytes are) and then
`complete`, last. One killed on the way leaves `complete` clear, and its successor loads from
disk again; a region that holds anything else (another layout, bytes from before) is
reloaded, never read.

Loaders call attach() before reading weights and keep() after (loader.fill_weights). On CUDA
the record is written by the stream that copied the forms, after them (pool_segment.py).
"""
from __future__ import annotations

import torch

from mcpd.config import ModelConfig
from mcpd.engine.kv_records import KEY_BYTES, region_key
from mcpd.memory.pool_segment import WEIGHTS, PoolSegment
from mcpd.kernels.forms import laid_out

MAGIC = 0x737468676965776D   # "mweights"
MAGIC_AT, COMPLETE_AT = range(2)   # the record's int64 fields, then `holds`
HOLDS_AT = 2 * 8
RECORD_BYTES = HOLDS_AT + KEY_BYTES
ALIGN = 64


class ResidentWeights:
    def __init__(self, segment: PoolSegment, owner: int, model: ModelConfig):
        self.segment, self.owner, self.model_config = segment, owner, model
        self.reused = False      # the region is a predecessor's
        self.from_pool = False   # the weights are a predecessor's: none was read or prepared

    def attach(self, model, name: str) -> bool:
        """Run model (a skeleton whose kernels are chosen) on a predecessor's complete region;
        False if there is none (the caller loads the weights, then calls keep)."""
        self._take_region(model, name)
        if not (self.reused and self.holds_key()):
            self.fields[COMPLETE_AT] = 0   # before any byte of the region changes
            return False
        model.use_forms(self.layout.views(self.memory))
        self.from_pool = True
        return True

    def keep(self, model) -> None:
        """Copy the loaded weights, each prepared for the kernels, into the region, and run model
        on them there."""
        self.layout.copy_in(model.kernel_forms(), self.memory)
        model.use_forms(self.layout.views(self.memory))
        self.fields[MAGIC_AT] = MAGIC
        self.holds.copy_(torch.frombuffer(bytearray(self.key), dtype=torch.uint8))
        self.fields[COMPLETE_AT] = 1   # last: every byte is in place, and holds says what they are
        if self.memory.is_cuda:
            torch.cuda.empty_cache()   # the loaded copies, else held by torch's cache beside the pool

    def holds_key(self) -> bool:
        """The record says the region is complete and holds what this worker's key names."""
        magic, complete = self.fields.tolist()
        return magic == MAGIC and complete == 1 and self.holds.cpu().numpy().tobytes() == self.key

    def _take_region(self, model, name: str) -> None:
        """Lay the model's forms out after the record and take owner's region for them."""
        self.layout = laid_out(model.kernel_forms(meta=True), RECORD_BYTES, ALIGN)
        self.key = region_key(self.model_config, name, ("weights", model.kernels.form, self.layout.signature()))
        region = self.segment.take(WEIGHTS, self.owner, self.key, self.layout.end)
        self.reused = region.reused
        self.memory = self.segment.buffer(region)   # checked to lie inside the pool
        self.fields, self.holds = self.memory[:HOLDS_AT].view(torch.int64), self.memory[HOLDS_AT:RECORD_BYTES]

"""A CPU step of decodes' input arrays, written into one kept buffer: no torch call a step.

After a decode step has streamed the weights, each distinct torch call the next step's Python
makes is cold, even torch.tensor of a short list or a view, and a batch-1 step is short enough
to feel each. Here its token ids and attention arrays are copied into one int64 tensor by one memmove, and
the views the step hands on are made again only when the batch's shape changes (at batch 1,
once every block_size tokens).

CPU only: the next step overwrites the views, which on the CPU is after this step has finished
with them (a GPU copy from them could still be in flight). The arrays are those of
AttentionMetadata.build for counts of 1, which the tests hold them equal to.
"""
from __future__ import annotations

import array
import ctypes

import torch

from mcpd.models.layers import AttentionGroup, AttentionMetadata, decode_width


class DecodeArrays:
    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.long)
        self.shape: tuple[int, int] | None = None   # (sequences, table width) the views are cut for
        self.views: tuple[torch.Tensor, ...] = ()

    def build(self, token_ids: list[int], block_tables: list[list[int]], starts: list[int],
              block_size: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """(the token ids, the step's metadata) of sequences that each compute one token, token_ids[i]
        at position starts[i], their KV in block_tables[i]."""
        width = decode_width(starts, block_size)
        values = array.array("q", token_ids)
        values.extend(starts)
        values.extend(table[start // block_size] for table, start in zip(block_tables, starts))
        values.extend(start % block_size for start in starts)
        values.extend(start + 1 for start in starts)
        for table in block_tables:
            row = table[:width]
            values.extend(row)
            values.extend([0] * (width - len(row)))   # nothing attends past its context length
        if (len(starts), width) != self.shape:
            self._cut(len(starts), width)
        ctypes.memmove(self.buffer.data_ptr(), values.buffer_info()[0], len(values) * values.itemsize)
        ids, positions, slot_blocks, slot_offsets, context_lens, table = self.views
        group = AttentionGroup(0, len(starts), table, context_lens)
        return ids, AttentionMetadata(positions, slot_blocks, slot_offsets, [group], max(starts) + 1)

    def _cut(self, sequences: int, width: int) -> None:
        """The views for a batch of this shape: five arrays of `sequences` and the block table."""
        size = sequences * (5 + width)
        if self.buffer.numel() < size:
            self.buffer = torch.empty(size, dtype=torch.long)
        arrays = self.buffer[:5 * sequences].view(5, sequences).unbind()
        table = self.buffer[5 * sequences:size].view(sequences, width)
        self.shape, self.views = (sequences, width), (*arrays, table)

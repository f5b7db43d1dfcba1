"""Building blocks shared by the model files: RMSNorm, rotary embedding, paged attention.

Paged attention works on a flat batch: every token scheduled this step, of every sequence, is one
row of [T, ...] tensors (prefill chunks and single decode tokens side by side, no padding in the
projections or MLPs). Only attention needs to know which rows belong to which sequence, and that
knowledge travels in AttentionMetadata, built once per step and shared by all layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, in the same order as transformers,
        # so half-precision models round the same way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """rope_scaling of type "llama3" (Llama 3.1+): long wavelengths are slowed down by `factor`."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_len = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / self.low_freq_factor, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= old_len / self.high_freq_factor) & (wavelen <= old_len / self.low_freq_factor)
        return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout of Hugging Face checkpoints.

    inv_freq is a plain attribute on an explicit device, not a buffer: models are built on the
    meta device and then filled from checkpoints, and a buffer would be left uninitialised.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Llama3RopeScaling | None,
                 device: torch.device) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        self.inv_freq = scaling.apply(inv_freq) if scaling else inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, [T, 1, head_dim], computed in float32 then cast."""
        freqs = positions.float()[:, None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class AttentionGroup:
    """Sequences that share one batched attention call.

    Single-token sequences (decodes) form one group with one query row each; sequences with several
    new tokens (prefill chunks) form another, padded to the longest chunk. Keeping them apart means
    thirty decodes next to a 2,000-token prefill do not each get padded to 2,000 queries.
    """
    start: int                        # the group's rows in the flat batch: [start, end)
    end: int
    block_table: torch.Tensor         # [B, W] each sequence's blocks, padded to the longest
    mask: torch.Tensor                # [B, 1, Q, W * block_size] True where a query may attend
    query_index: torch.Tensor | None  # [B, Q] group row of each query; None when Q == 1
    output_rows: torch.Tensor | None  # rows of the [B*Q] output that are real tokens; None when Q == 1


@dataclass
class AttentionMetadata:
    positions: torch.Tensor     # [T] position of each new token in its sequence
    slot_blocks: torch.Tensor   # [T] where each new token's key and value are written
    slot_offsets: torch.Tensor  # [T]
    groups: list[AttentionGroup]

    @classmethod
    def build(cls, block_tables: list[list[int]], starts: list[int], counts: list[int],
              block_size: int, device: torch.device) -> AttentionMetadata:
        """Describe one step: sequence i computes tokens [starts[i], starts[i] + counts[i]), and its
        KV lives in the blocks block_tables[i] (covering at least starts[i] + counts[i] tokens).
        Its new tokens are rows sum(counts[:i]) ... of the flat batch."""
        groups, positions, slot_blocks, slot_offsets = [], [], [], []
        begin = row = 0
        while begin < len(counts):
            single = counts[begin] == 1
            end = begin
            while end < len(counts) and (counts[end] == 1) == single:
                end += 1
            group, pos, blocks = _build_group(block_tables[begin:end], starts[begin:end],
                                              counts[begin:end], row, block_size, device)
            groups.append(group)
            positions.append(pos)
            slot_blocks.append(blocks)
            slot_offsets.append(pos % block_size)
            row = group.end
            begin = end
        return cls(torch.cat(positions), torch.cat(slot_blocks), torch.cat(slot_offsets), groups)


def _build_group(block_tables, starts, counts, row, block_size, device):
    """One group's attention inputs, plus the positions and KV blocks of its new tokens."""
    num_queries = max(counts)
    width = -(-max(s + n for s, n in zip(starts, counts)) // block_size)
    # Short tables are padded with block 0: the mask keeps every query off those keys.
    table = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in block_tables],
                         dtype=torch.long, device=device)
    start = torch.tensor(starts, device=device)
    count = torch.tensor(counts, device=device)
    step = torch.arange(num_queries, device=device)
    # A padding query repeats its sequence's last token, so its softmax row is never empty.
    query_pos = torch.minimum(start[:, None] + step, (start + count - 1)[:, None])
    key_pos = torch.arange(width * block_size, device=device)
    # Causal in absolute positions; a query at p <= context - 1 also never sees padding keys.
    mask = (key_pos <= query_pos[:, :, None])[:, None]
    if num_queries == 1:
        group = AttentionGroup(row, row + len(counts), table, mask, query_index=None, output_rows=None)
        return group, start, table.gather(1, (start // block_size)[:, None]).squeeze(1)
    real = step < count[:, None]
    first_row = torch.cumsum(count, 0) - count
    group = AttentionGroup(row, row + sum(counts), table, mask,
                           query_index=first_row[:, None] + (query_pos - start[:, None]),
                           output_rows=real.flatten().nonzero().squeeze(1))
    return group, query_pos[real], table.gather(1, query_pos // block_size)[real]


class PagedAttention(nn.Module):
    """Attention of the flat batch's queries over each sequence's cached context.

    kv_cache is this layer's [num_blocks, 2, block_size, kv_heads, head_dim] view of the engine's
    KV tensor, handed in by bind_kv_cache(); the module owns no memory of its own.
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads, D]; k, v: [T, kv_heads, D]; returns [T, heads * D]."""
        self.kv_cache[attn.slot_blocks, 0, attn.slot_offsets] = k
        self.kv_cache[attn.slot_blocks, 1, attn.slot_offsets] = v
        outputs = [self._attend(q[g.start:g.end], g) for g in attn.groups]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _attend(self, q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
        keys, values = self._gather(0, group.block_table), self._gather(1, group.block_table)
        if group.query_index is None:
            queries = q[:, :, None]                                 # [B, heads, 1, D]
        else:
            queries = q[group.query_index].transpose(1, 2)          # [B, heads, Q, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask,
                                             scale=self.scale, enable_gqa=True)
        out = out.transpose(1, 2).flatten(2)                        # [B, Q, heads * D]
        if group.output_rows is None:
            return out[:, 0]
        return out.flatten(0, 1)[group.output_rows]

    def _gather(self, which: int, block_table: torch.Tensor) -> torch.Tensor:
        """Keys (0) or values (1) of the blocks in block_table: [B, kv_heads, W * block_size, D].
        Whole blocks are contiguous runs of memory, and index_select copies them as such (several
        times faster on the CPU than the equivalent advanced indexing)."""
        batch, width = block_table.shape
        blocks = self.kv_cache[:, which].index_select(0, block_table.flatten())
        return blocks.view(batch, width * blocks.shape[1], *blocks.shape[2:]).transpose(1, 2)


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor) -> None:
    """Give each PagedAttention, in layer order, its slice of [blocks, layers, 2, ...]."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    if len(layers) != kv_cache.shape[1]:
        raise ValueError(f"KV cache has {kv_cache.shape[1]} layers, the model {len(layers)}")
    for index, layer in enumerate(layers):
        layer.kv_cache = kv_cache[:, index]

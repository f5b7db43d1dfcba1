"""Building blocks shared by the model files: embedding, RMSNorm, rotary embedding, paged attention.

Paged attention works on a flat batch: every token scheduled this step, of every sequence, is one
row of [T, ...] tensors (prefill chunks and single decode tokens side by side, no padding in the
projections or MLPs). Only attention needs to know which rows belong to which sequence, and that
knowledge travels in AttentionMetadata, built once per step and shared by all layers.
"""
from __future__ import annotations

import array
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from mcpd.models import rope_frequencies
from mcpd.models.rope_scaling import RopeScaling
from mcpd.kernels.torch_kernels import TORCH, TorchKernels


class Embedding(nn.Embedding):
    """nn.Embedding without its random initialisation. Models are built on the meta device and
    then filled from a checkpoint (or the embedded model's seed), so it would be thrown away; and
    on the meta device its normal_ runs through torch._refs, whose first use imports torch._dynamo:
    about a second of CPU in every worker and standby start."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    """The weight and epsilon of an RMSNorm; the kernels (add_rms_norm) compute it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout of Hugging Face checkpoints.

    inv_freq is a plain attribute on an explicit device, not a buffer: models are built on the
    meta device and then filled from checkpoints, and a buffer would be left uninitialised.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.inv_freq = rope_frequencies.inverse_frequencies(head_dim, theta, scaling, device)
        self.attention_factor = rope_frequencies.attention_factor(scaling)
        self.tables: dict[torch.dtype, torch.Tensor] = {}

    @property
    def by_length(self) -> bool:
        """Whether a row's angles depend on its sequence's length at the step (dynamic, longrope):
        then for_step's table is the step's own, not a table by position."""
        return self.scaling is not None and self.scaling.by_length

    def table(self, positions: int, dtype: torch.dtype) -> torch.Tensor:
        """[P, 2, head_dim] float32: cos and sin of positions 0 .. P-1 (P >= positions, grown by
        doubling), computed in float32 and rounded to dtype as transformers rounds them."""
        table = self.tables.get(dtype)
        if table is None or table.shape[0] < positions:
            length = 1 << max(positions - 1, 1).bit_length()
            table = self._cos_sin(torch.arange(length, device=self.inv_freq.device).float()[:, None] * self.inv_freq,
                                  dtype)
            self.tables[dtype] = table
        return table

    def for_step(self, attn: AttentionMetadata, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, rows): the cos and sin of each row of the step are table[rows[i]]."""
        if not self.by_length:
            return self.table(attn.num_positions, dtype), attn.positions
        inv_freq = rope_frequencies.by_length(self.head_dim, self.theta, self.scaling, attn.sequence_lengths(),
                                              self.inv_freq)
        rows = torch.arange(len(attn.positions), device=attn.positions.device)
        return self._cos_sin(attn.positions.float()[:, None] * inv_freq, dtype), rows

    def _cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        return torch.stack((cos, sin), dim=1).to(dtype).float()


@dataclass
class AttentionGroup:
    """Sequences that share one batched attention call.

    Single-token sequences (decodes) form one group with one query row each, which the kernels'
    decode_attention serves from the paged cache in place; sequences with several new tokens
    (prefill chunks) form another, padded to the longest chunk, for torch's attention. Keeping
    them apart means thirty decodes next to a 2,000-token prefill do not each get padded to 2,000
    queries.
    """
    start: int                        # the group's rows in the flat batch: [start, end)
    end: int
    block_table: torch.Tensor         # [B, W] each sequence's blocks, padded to the longest
    context_lens: torch.Tensor        # [B] tokens each sequence attends to, its new ones included
    starts: torch.Tensor | None = None       # prefill: [B] position of each sequence's first new token
    counts: torch.Tensor | None = None       # prefill: [B] its new tokens
    first_rows: torch.Tensor | None = None   # prefill: [B] group row of its first new token
    mask: torch.Tensor | None = None         # prefill: [B, 1, Q, W * block_size] True where a query may attend
    query_index: torch.Tensor | None = None  # prefill: [B, Q] group row of each query
    output_rows: torch.Tensor | None = None  # prefill: rows of the [B*Q] output that are real tokens
    first_keys: torch.Tensor | None = None   # decode in a sliding window: [B] first position each may attend to

    @property
    def decoding(self) -> bool:
        return self.mask is None

    def windowed(self, window: int) -> AttentionGroup:
        """This group with each query seeing itself and the window - 1 keys before it only."""
        if self.decoding:
            return dataclasses.replace(self, first_keys=(self.context_lens - window).clamp(min=0))
        query_pos = self.query_index - self.first_rows[:, None] + self.starts[:, None]
        key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
        return dataclasses.replace(self, mask=self.mask & (key_pos > query_pos[:, :, None] - window)[:, None])


@dataclass
class AttentionMetadata:
    positions: torch.Tensor     # [T] position of each new token in its sequence
    slot_blocks: torch.Tensor   # [T] where each new token's key and value are written
    slot_offsets: torch.Tensor  # [T]
    groups: list[AttentionGroup]
    num_positions: int          # 1 + the highest position in the step
    windows: dict[int, list[AttentionGroup]] = field(default_factory=dict)   # groups by sliding window, made once

    def sequence_lengths(self) -> torch.Tensor:
        """[T]: each row's sequence's length at the end of the step."""
        lengths = [g.context_lens if g.decoding else g.context_lens.repeat_interleave(g.counts) for g in self.groups]
        return lengths[0] if len(lengths) == 1 else torch.cat(lengths)

    def groups_within(self, window: int | None) -> list[AttentionGroup]:
        """The groups as a layer with this sliding window (None: none) attends."""
        if window is None:
            return self.groups
        groups = self.windows.get(window)
        if groups is None:
            groups = self.windows[window] = [group.windowed(window) for group in self.groups]
        return groups

    @classmethod
    def build(cls, block_tables: list[list[int]], starts: list[int], counts: list[int],
              block_size: int, device: torch.device) -> AttentionMetadata:
        """Describe one step: sequence i computes tokens [starts[i], starts[i] + counts[i]), and its
        KV lives in the blocks block_tables[i] (covering at least starts[i] + counts[i] tokens).
        Its new tokens are rows sum(counts[:i]) ... of the flat batch. Built from Python lists
        with one tensor per array: a decode step of many sequences costs tens of microseconds."""
        groups, positions, slot_blocks = [], [], []
        begin = row = 0
        while begin < len(counts):
            single = counts[begin] == 1
            end = begin
            while end < len(counts) and (counts[end] == 1) == single:
                end += 1
            tables, group_starts, group_counts = block_tables[begin:end], starts[begin:end], counts[begin:end]
            for table, start, count in zip(tables, group_starts, group_counts):
                positions += range(start, start + count)
                slot_blocks += (table[p // block_size] for p in range(start, start + count))
            build = _decode_group if single else _prefill_group
            groups.append(build(tables, group_starts, group_counts, row, block_size, device))
            row = groups[-1].end
            begin = end
        positions_tensor = long_tensor(positions, device)
        return cls(positions_tensor, long_tensor(slot_blocks, device), positions_tensor % block_size,
                   groups, max(s + n for s, n in zip(starts, counts)))


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """torch.tensor(values) of a non-empty list of Python ints, through an array: torch.tensor reads
    a list item by item, a Python object at a time, which a long prompt's step pays per token."""
    return torch.frombuffer(array.array("q", values), dtype=torch.long).to(device)


def _padded_table(block_tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    # Short tables are padded with block 0: nothing attends past its context length.
    return torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in block_tables],
                        dtype=torch.long, device=device)


def decode_width(starts: list[int], block_size: int) -> int:
    """Blocks a decode group's table needs: the longest context's, its new token included."""
    return -(-(max(starts) + 1) // block_size)


def _decode_group(block_tables, starts, counts, row, block_size, device) -> AttentionGroup:
    width = decode_width(starts, block_size)
    return AttentionGroup(row, row + len(starts), _padded_table(block_tables, width, device),
                          torch.tensor([s + 1 for s in starts], device=device))


def _prefill_group(block_tables, starts, counts, row, block_size, device) -> AttentionGroup:
    num_queries = max(counts)
    width = -(-max(s + n for s, n in zip(starts, counts)) // block_size)
    start = torch.tensor(starts, device=device)
    count = torch.tensor(counts, device=device)
    step = torch.arange(num_queries, device=device)
    # A padding query repeats its sequence's last token, so its softmax row is never empty.
    query_pos = torch.minimum(start[:, None] + step, (start + count - 1)[:, None])
    key_pos = torch.arange(width * block_size, device=device)
    # Causal in absolute positions; a query at p <= context - 1 also never sees padding keys.
    mask = (key_pos <= query_pos[:, :, None])[:, None]
    real = step < count[:, None]
    first_row = torch.cumsum(count, 0) - count
    return AttentionGroup(row, row + sum(counts), _padded_table(block_tables, width, device), start + count,
                          start, count, first_row, mask, query_index=first_row[:, None] + (query_pos - start[:, None]),
                          output_rows=real.flatten().nonzero().squeeze(1))


class PagedAttention(nn.Module):
    """Attention of the flat batch's queries over each sequence's cached context.

    kv_cache is this layer's [num_blocks, 2, block_size, kv_heads, head_dim] view of the engine's
    KV tensor, handed in by bind_kv_cache(); the module owns no memory of its own.
    """

    def __init__(self, scale: float, window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.scale = scale
        self.window = window   # sliding window: each query sees itself and window - 1 keys before
        self.options = {} if softcap is None else {"softcap": softcap}   # only the torch kernels take them
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """Store k, v [T, kv_heads, D] in the cache and attend: q [T, heads, D] -> [T, heads * D]."""
        self.kv_cache[attn.slot_blocks, 0, attn.slot_offsets] = k
        self.kv_cache[attn.slot_blocks, 1, attn.slot_offsets] = v
        return self.attend(q, attn, TORCH)

    def attend(self, q: torch.Tensor, attn: AttentionMetadata, kernels: TorchKernels) -> torch.Tensor:
        """Attention of q [T, heads, D] over the cache, whose keys and values for this step's
        tokens are already written; returns [T, heads * D]."""
        outputs = [(kernels.decode_attention if g.decoding else kernels.prefill_attention)(
                       q[g.start:g.end], self.kv_cache, g, self.scale, **self.options)
                   for g in attn.groups_within(self.window)]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor) -> None:
    """Give each PagedAttention, in layer order, its slice of [blocks, layers, 2, ...]."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    if len(layers) != kv_cache.shape[1]:
        raise ValueError(f"KV cache has {kv_cache.shape[1]} layers, the model {len(layers)}")
    for index, layer in enumerate(layers):
        layer.kv_cache = kv_cache[:, index]

"""The compute kernels a Llama forward pass is made of, in torch ops: on any device and dtype, the
portable path (CUDA, float16, odd shapes, no C compiler) and the reference the native kernels
(native_kernels.py) and the CUDA ones (cuda_kernels.py) are tested against. Every kernel set has
this interface; choice.py picks one for a model.

Each op mirrors the order of roundings of transformers' Llama, so that every kernel set gives
transformers' greedy tokens in float32 and in bfloat16.

Weight-only int8 matrices (quant/int8.py): the torch twin rounds x to int16 and converts the
integers at each product (int8.linear), as the native kernels multiply them; on a CUDA device a
Triton kernel takes x as it is (quant/int8_cuda.py). 4-bit ones (quant/int4.py): int4.linear, a
panel of rows at a time; on a CUDA device with Triton, its kernels (quant/int4_cuda.py).
"""
from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

from mcpd.kernels.row_parts import RowParts
from mcpd.quant import int4, int8
from mcpd.quant.int4 import Int4Weight
from mcpd.quant.int8 import Int8Weight

# Triton comes with torch's CUDA builds, not the CPU ones; where a CUDA build lacks it, the 4-bit
# products stay the twin's.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, "rotate half" layout (Hugging Face checkpoints); x: [T, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class TorchKernels:
    name = "torch"
    # The layout prepare() writes, named: weights kept in the device pool in one form are not
    # read by kernels of another (engine/resident_weights.py). Rename it when the layout changes.
    form = "plain"
    stacks_layers = False   # whether the model runs its decoder stack as one call of these (native_stack.py)

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight matrix in the form linear() takes: for torch, as it is. Every prepare() runs
        on a meta tensor too (giving the form's shapes): the pool lays weights out before reading any."""
        return weight

    def embedding(self, ids: torch.Tensor, table, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids of table in dtype, the model's (a quantized table's dequantized)."""
        if isinstance(table, Int8Weight):
            return int8.rows(ids, table).to(dtype)
        if isinstance(table, Int4Weight):
            return int4.rows(ids, table).to(dtype)
        return F.embedding(ids, table)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight | Int4Weight | RowParts,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, RowParts):
            return weight.linear(self, x, bias)
        if isinstance(weight, Int4Weight):
            if x.is_cuda and HAS_TRITON:
                from mcpd.quant import int4_cuda
                return int4_cuda.linear(x, weight, bias)
            return int4.linear(x, weight, bias)
        if isinstance(weight, Int8Weight):
            if x.is_cuda:   # imported here: Triton comes with torch's CUDA builds, not the CPU ones
                from mcpd.quant import int8_cuda
                return int8_cuda.linear(x, weight, bias)
            return int8.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def logits(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight | Int4Weight | RowParts) -> torch.Tensor:
        """float32 logits, rounded to the model dtype first as transformers' lm_head rounds them;
        a quantized head (a Q4_K_M file's Q6_K) through linear's products."""
        return self.linear(x, weight).float()

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token: logits.argmax(dim=-1), the first of equal maxima (a NaN counting
        as the largest) alike. On the CPU through numpy: torch's reduction's setup costs several
        times numpy's whole argmax of a vocabulary-sized row."""
        if logits.device.type != "cpu":
            return logits.argmax(dim=-1)
        return torch.from_numpy(logits.numpy().argmax(axis=-1))

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, RMSNorm of it). Normalised in float32 and scaled in the model dtype,
        in the order of transformers, so half-precision models round the same way."""
        if delta is not None:
            residual = residual + delta
        x32 = residual.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return residual, weight * x32.to(residual.dtype)

    def attention_inputs(self, residual: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor,
                         eps: float, weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None, heads: int,
                         kv_heads: int, head_dim: int, table: torch.Tensor, positions: torch.Tensor,
                         slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                         kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, the queries): add_rms_norm, the q/k/v product and rope_store (keys
        and values into the cache), in one call so that a kernel set can fuse them (the CUDA
        kernels do at one row)."""
        residual, x = self.add_rms_norm(residual, delta, norm_weight, eps)
        q = self.rope_store(self.linear(x, weight, bias), heads, kv_heads, head_dim, table, positions, slot_blocks,
                            slot_offsets, kv_cache)
        return residual, q

    def rope_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, table: torch.Tensor,
                   positions: torch.Tensor, slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                   kv_cache: torch.Tensor) -> torch.Tensor:
        """Rotate the queries and keys of qkv [T, (heads + 2 kv_heads) * head_dim] by their
        positions (cos and sin from table [positions, 2, head_dim]), write keys and values into
        the layer's cache [blocks, 2, block_size, kv_heads, head_dim] at their slots; return the
        queries [T, heads, head_dim]."""
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        cos_sin = table[positions].to(qkv.dtype)
        cos, sin = cos_sin[:, None, 0], cos_sin[:, None, 1]
        q = rotate(q.view(-1, heads, head_dim), cos, sin)
        kv_cache[slot_blocks, 0, slot_offsets] = rotate(k.view(-1, kv_heads, head_dim), cos, sin)
        kv_cache[slot_blocks, 1, slot_offsets] = v.view(-1, kv_heads, head_dim)
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, group, scale: float,
                         softcap: float | None = None) -> torch.Tensor:
        """One query per sequence, q [B, heads, D], over the first group.context_lens[i] tokens
        of the blocks group.block_table[i] of kv_cache (a layer's [blocks, 2, block_size,
        kv_heads, D]), from group.first_keys[i] on in a sliding window; returns [B, heads * D].
        softcap: scores soft-capped (_attention)."""
        batch, width = group.block_table.shape
        keys, values = _gather(kv_cache, group.block_table)
        key_pos = torch.arange(width * kv_cache.shape[2], device=q.device)
        mask = key_pos < group.context_lens[:, None]
        if group.first_keys is not None:
            mask &= key_pos >= group.first_keys[:, None]
        out = _attention(q[:, :, None], keys, values, mask[:, None, None], scale, softcap)
        return out.flatten(1)

    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, group, scale: float,
                          softcap: float | None = None) -> torch.Tensor:
        """The group's new tokens, q [rows, heads, D], each over its sequence's tokens up to
        itself (causal); returns [rows, heads * D]. Chunks are padded to the longest (group.mask
        keeps each query causal, group.output_rows drops the padding)."""
        keys, values = _gather(kv_cache, group.block_table)
        queries = q[group.query_index].transpose(1, 2)          # [B, heads, Q, D]
        out = _attention(queries, keys, values, group.mask, scale, softcap)
        return out.transpose(1, 2).flatten(2).flatten(0, 1)[group.output_rows]


def _attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float | None) -> torch.Tensor:
    """Masked attention, [B, heads, Q, D] over [B, kv_heads, S, D]: torch's fused kernel, or with
    soft-capped scores (tanh(scores / cap) * cap, Gemma 2), which it cannot do, step by step in
    transformers' order."""
    if softcap is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.tanh(queries @ keys.transpose(2, 3) * scale / softcap) * softcap
    weights = scores.masked_fill(~mask, -math.inf).softmax(dim=-1, dtype=torch.float32).to(queries.dtype)
    return weights @ values


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in block_table [B, W]: each [B, kv_heads, W * block_size, D].
    Whole blocks are contiguous runs of memory, and index_select copies them as such (several
    times faster on the CPU than the equivalent advanced indexing)."""
    batch, width = block_table.shape
    blocks = kv_cache.index_select(0, block_table.flatten())   # [B * W, 2, block_size, kv_heads, D]
    blocks = blocks.view(batch, width, 2, kv_cache.shape[2], *kv_cache.shape[3:])
    return tuple(blocks[:, :, i].flatten(1, 2).transpose(1, 2) for i in (0, 1))


TORCH = TorchKernels()

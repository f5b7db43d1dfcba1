"""The kernels on a CUDA device: torch's, with decode attention reading the paged KV cache in place
(a Triton kernel).

The torch twin (TorchKernels.decode_attention) copies every sequence's whole context out of the
cache with index_select before each layer's attention, then masks the padding: a batch of 64
sequences of 2,000 tokens copies ~1 GB a step on a 1B model. Here one program per (sequence, KV
head) walks the sequence's own tokens through its block table and never writes them anywhere.

Each program holds the query heads that share its KV head (GQA) as the rows of one tile, so a
key block is read once for all of them; TOKENS tokens at a time (any block size: each token's
block comes from the table), scores by tl.dot, an online softmax in float32 (running maximum and
sum, as flash attention), and the values' weighted sum by a second dot. A float32 model's dots run
in IEEE float32, not TF32: greedy parity with transformers holds in float32 (tests run on a GPU).

The kernel reads only a sequence's first context_lens tokens (masked loads past them), so block
table rows may be padded with anything, and a CUDA graph can capture it at a fixed table width
(engine/decode_graphs.py): the work follows the lengths in device memory, not the shapes.

Left for later: one program per (sequence, KV head) leaves most of a big GPU idle at batch 1 with
a long context (split-K "flash decoding" would spread it); at the lengths bench/gpu_decode.py
runs, attention is a small part of a step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mcpd.models.kernels import TorchKernels

TOKENS = 64   # tokens a program scores at a time (a tile's columns)


@triton.jit
def _paged_decode(q, cache, table, context_lens, out, q_row_stride, out_row_stride, block_stride, value_offset,
                  token_stride, table_stride, block_size, scale,
                  GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
                  IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_TILE)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    queries = tl.load(q + seq * q_row_stride + heads[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None],
                      other=0.0)
    length = tl.load(context_lens + seq)
    best = tl.full((GROUP_TILE,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_TILE,), tl.float32)
    acc = tl.zeros((GROUP_TILE, HEAD_DIM), tl.float32)
    for start in tl.range(0, length, TOKENS):
        tokens = start + tl.arange(0, TOKENS)
        token_ok = tokens < length
        blocks = tl.load(table + seq * table_stride + tokens // block_size, mask=token_ok, other=0)
        where = (blocks.to(tl.int64) * block_stride + (tokens % block_size) * token_stride + kv_head * HEAD_DIM)
        keys = tl.load(cache + where[:, None] + dims[None, :], mask=token_ok[:, None], other=0.0)
        if IEEE:
            scores = tl.dot(queries, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(queries, tl.trans(keys))
        scores = tl.where(token_ok[None, :], scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_best[:, None])
        fade = tl.exp(best - new_best)
        total = total * fade + tl.sum(weights, axis=1)
        values = tl.load(cache + value_offset + where[:, None] + dims[None, :], mask=token_ok[:, None], other=0.0)
        if IEEE:
            acc = acc * fade[:, None] + tl.dot(weights, values.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * fade[:, None] + tl.dot(weights.to(values.dtype), values)
        best = new_best
    result = acc / total[:, None]
    tl.store(out + seq * out_row_stride + heads[:, None] * HEAD_DIM + dims[None, :],
             result.to(out.dtype.element_ty), mask=row_ok[:, None])


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, q [B, heads, D], over the first context_lens[i] tokens of the blocks
    block_table[i] of kv_cache (a layer's [blocks, 2, block_size, kv_heads, D] view); returns
    [B, heads * D], as TorchKernels.decode_attention."""
    batch, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[3]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty(batch, heads * head_dim, dtype=q.dtype, device=q.device)
    _paged_decode[(batch, kv_heads)](
        q, kv_cache, block_table, context_lens, out, q.stride(0), out.stride(0), kv_cache.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0), kv_cache.shape[2], scale,
        GROUP=group, GROUP_TILE=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, TOKENS=TOKENS,
        IEEE=q.dtype == torch.float32)
    return out


def supports(head_dim: int, kv_cache_strides: tuple[int, ...]) -> bool:
    """Whether the kernel runs this layout: a power-of-two head size of 16 or more (a tile's
    columns), each token's head dims contiguous in the cache."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and kv_cache_strides[-1] == 1


class CudaKernels(TorchKernels):
    """TorchKernels with the paged decode attention above (prefill chunks keep torch's gather and
    SDPA: a chunk's many queries amortise the copy). Same weights' form as torch's."""
    name = "cuda"

    def decode_attention(self, q, kv_cache, group, scale):
        if not supports(q.shape[2], kv_cache.stride()):
            return super().decode_attention(q, kv_cache, group, scale)
        return decode_attention(q, kv_cache, group.block_table, group.context_lens, scale)

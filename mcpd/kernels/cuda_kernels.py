"""The kernels on a CUDA device: torch's, with the small ops of a layer fused into Triton kernels
and decode attention reading the paged KV cache in place.

Why: a decode step of a small batch is a few large products and many small ops, and unfused, the
small ops' launches cost several times the weights' read. Here a layer of a
one-sequence decode is seven kernels (eight when attention's context is split): the q/k/v product
with the norm before it and rope_store after it (attention_inputs), attention, the o product,
add_rms_norm, the gate/up product, silu_mul, the down product. Inside a CUDA graph each kernel
still costs a few microseconds beyond its work, so fewer kernels is the lever at one row; larger
batches run the unfused ops.

- add_rms_norm: the residual addition and the RMSNorm of each row, in one program a row.
- rope_store: each head of each token rotated (queries and keys) and the keys and values written
  into their cache slots, one program a (token, head).
- silu_mul: silu(gate) * up.
- linear of one row by a 16-bit matrix of up to ROW_PRODUCT_MOST_OUTPUTS outputs (q/k/v, o,
  down): a Triton product, one program per 8 outputs, which reads such matrices faster than
  cuBLAS does at one row. Larger matrices (gate/up, the LM head) stay cuBLAS's, as fast or
  faster there.
- attention_inputs at one row: the same product kernel computing its input row from the norm
  (each program the row's scale from the whole row, then each value as add_rms_norm gives it)
  and rotating and storing its outputs as rope_store does (a program then takes 4 values of a
  head's first half and the 4 paired with them): the unfused kernels' bits, one kernel for
  three. silu_mul stays a kernel of its own: folded into the down product it gains nothing.
Each rounds where torch's ops round (to the model dtype after every op, from float32 math), so a
bfloat16 model computes what the torch twin computes, up to the order of a row's sum.

decode_attention: the torch twin copies every sequence's whole context out of the cache with
index_select before each layer's attention; here programs walk each sequence's own tokens through
its block table and never write them anywhere. A program holds the query heads that share its KV
head (GQA) as the rows of one tile, so a key is read once for all of them; TOKENS tokens at a
time (any block size: each token's block comes from the table), scores by tl.dot, an online
softmax in float32, the values' weighted sum by a second dot. A small batch would leave most of
the GPU idle with one program per (sequence, KV head), so the context is split among `splits`
programs each ("flash decoding"), whose partial sums a second kernel merges. A float32 model's
dots run in IEEE float32, not TF32: greedy parity with transformers holds (tests run on a GPU).

Only a sequence's first context_lens tokens are read (masked loads past them), and the number of
splits follows the shapes, not the lengths: a CUDA graph can capture it at a fixed table width
(engine/decode_graphs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mcpd.kernels.torch_kernels import TorchKernels

TOKENS = 64        # tokens a program scores at a time (a tile's columns)
MOST_SPLITS = 16   # programs one (sequence, KV head) is split among, at most


@triton.jit
def _paged_decode(q, cache, table, context_lens, out, partial_acc, partial_best, partial_total, q_row_stride,
                  out_row_stride, block_stride, value_offset, token_stride, table_stride, block_size, scale,
                  GROUP: tl.constexpr, GROUP_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
                  SPLITS: tl.constexpr, IEEE: tl.constexpr):
    _attend(q, cache, table, context_lens, out, partial_acc, partial_best, partial_total, q_row_stride,
            out_row_stride, block_stride, value_offset, token_stride, table_stride, block_size, scale,
            tl.program_id(0), tl.program_id(1), tl.num_programs(1), tl.program_id(2), GROUP, GROUP_TILE, HEAD_DIM,
            TOKENS, SPLITS, IEEE)


@triton.jit
def _attend(q, cache, table, context_lens, out, partial_acc, partial_best, partial_total, q_row_stride,
            out_row_stride, block_stride, value_offset, token_stride, table_stride, block_size, scale, seq, kv_head,
            kv_heads, split, GROUP, GROUP_TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
            TOKENS: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    """One (sequence, KV head, split): its query heads against the split's share of the context.
    Queries and partials are read past the L1 cache (.cg): in the one-kernel decode step other
    programs wrote them moments before."""
    rows = tl.arange(0, GROUP_TILE)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    queries = tl.load(q + seq * q_row_stride + heads[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None],
                      other=0.0, cache_modifier=".cg")
    length = tl.load(context_lens + seq)
    chunk = _split_chunk(length, SPLITS, TOKENS)
    first = split * chunk
    last = tl.minimum(first + chunk, length)
    best = tl.full((GROUP_TILE,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_TILE,), tl.float32)
    acc = tl.zeros((GROUP_TILE, HEAD_DIM), tl.float32)
    for start in tl.range(first, last, TOKENS):   # no tile when the split starts past the length
        tokens = start + tl.arange(0, TOKENS)
        token_ok = tokens < last
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
    if SPLITS == 1:
        tl.store(out + seq * out_row_stride + heads[:, None] * HEAD_DIM + dims[None, :],
                 (acc / total[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None])
    else:   # partials [B, heads, SPLITS, (D)]: an empty split leaves best -inf, total and acc 0
        at = (seq * kv_heads * GROUP + heads) * SPLITS + split
        tl.store(partial_best + at, best, mask=row_ok)
        tl.store(partial_total + at, total, mask=row_ok)
        tl.store(partial_acc + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _split_chunk(length, SPLITS: tl.constexpr, TOKENS: tl.constexpr):
    """The tokens of each split of a context of `length`: whole tiles."""
    return tl.cdiv(tl.cdiv(length, SPLITS), TOKENS) * TOKENS


@triton.jit
def _merge_splits(partial_acc, partial_best, partial_total, out, out_row_stride, HEADS, GROUP,
                  GROUP_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    _merge(partial_acc, partial_best, partial_total, out, out_row_stride, tl.program_id(0), tl.program_id(1), HEADS,
           GROUP, GROUP_TILE, HEAD_DIM, SPLITS)


@triton.jit
def _merge(partial_acc, partial_best, partial_total, out, out_row_stride, seq, kv_head, HEADS, GROUP,
           GROUP_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    """The attention output of one (sequence, KV head)'s query heads from their splits' partial
    sums, all heads and splits read at once."""
    members = tl.arange(0, GROUP_TILE)
    ok = members < GROUP
    heads = kv_head * GROUP + members
    at = (seq * HEADS + heads[:, None]) * SPLITS + tl.arange(0, SPLITS)[None, :]
    dims = tl.arange(0, HEAD_DIM)
    best = tl.load(partial_best + at, mask=ok[:, None], other=0.0, cache_modifier=".cg")
    fade = tl.exp(best - tl.max(best, axis=1)[:, None])   # finite: each head's first split has a token
    total = tl.sum(tl.load(partial_total + at, mask=ok[:, None], other=0.0, cache_modifier=".cg") * fade, axis=1)
    acc = tl.load(partial_acc + at[:, :, None] * HEAD_DIM + dims[None, None, :], mask=ok[:, None, None], other=0.0,
                  cache_modifier=".cg")
    acc = tl.sum(acc * fade[:, :, None], axis=1)
    tl.store(out + seq * out_row_stride + heads[:, None] * HEAD_DIM + dims[None, :],
             (acc / total[:, None]).to(out.dtype.element_ty), mask=ok[:, None])


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
    splits = split_count(batch * kv_heads, q.device)
    partial = [torch.empty(batch * heads * splits * size, dtype=torch.float32, device=q.device)
               for size in (head_dim, 1, 1)] if splits > 1 else [out] * 3
    _paged_decode[(batch, kv_heads, splits)](
        q, kv_cache, block_table, context_lens, out, *partial, q.stride(0), out.stride(0), kv_cache.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0), kv_cache.shape[2], scale,
        GROUP=group, GROUP_TILE=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, TOKENS=TOKENS,
        SPLITS=splits, IEEE=q.dtype == torch.float32)
    if splits > 1:
        _merge_splits[(batch, kv_heads)](*partial, out, out.stride(0), heads, group,
                                         GROUP_TILE=triton.next_power_of_2(group), HEAD_DIM=head_dim, SPLITS=splits)
    return out


def split_count(programs: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough programs for two per multiprocessor, a power of two
    up to MOST_SPLITS; 1 once the batch fills the GPU. From shapes only (see the docstring)."""
    processors = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8)
    return min(MOST_SPLITS, triton.next_power_of_2(max(1, -(-2 * processors // programs))))


@triton.jit
def _add_rms_norm(residual, delta, weight, out, size, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < size
    x = _summed(residual + row * size, delta + row * size, cols, ok, HAS_DELTA)
    if HAS_DELTA:
        tl.store(residual + row * size + cols, x, mask=ok)
    y = _normed(x, _rms_inverse(x, size, eps), tl.load(weight + cols, mask=ok, other=0.0))
    tl.store(out + row * size + cols, y.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _summed(x, delta, cols, ok, HAS_DELTA: tl.constexpr):
    """x (+ delta) at cols, the sum rounded to x's dtype as torch's addition rounds it."""
    values = tl.load(x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        values = (values.to(tl.float32) + tl.load(delta + cols, mask=ok, other=0.0).to(tl.float32)).to(values.dtype)
    return values


@triton.jit
def _rms_inverse(row, size, eps):
    """1 / the root mean square of a row's values (+ eps), in float32: RMSNorm's scale."""
    row32 = row.to(tl.float32)
    return tl.rsqrt(tl.sum(row32 * row32, axis=0) / size + eps)


@triton.jit
def _normed(x, inverse, weight):
    """RMSNorm's output for values x of a row, in float32: x * inverse rounded to x's dtype (as
    transformers rounds before the weight), times the weight."""
    return weight.to(tl.float32) * (x.to(tl.float32) * inverse).to(x.dtype).to(tl.float32)


@triton.jit
def _rope_store(qkv, table, positions, slot_blocks, slot_offsets, q_out, cache, qkv_row_stride, block_stride,
                value_offset, token_stride, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)   # queries, then keys, then values
    half = tl.arange(0, HALF)
    source = qkv + row * qkv_row_stride + head * 2 * HALF
    _rotate_store(tl.load(source + half), tl.load(source + HALF + half), head, half, row, table, positions,
                  slot_blocks, slot_offsets, q_out, cache, block_stride, value_offset, token_stride, HEADS,
                  KV_HEADS, HALF)


@triton.jit
def _rotated(x1, x2, angles, index, HALF: tl.constexpr):
    """x * cos + cat(-x2, x1) * sin for the halves x1 (at `index`) and x2 of heads (any leading
    shape), by the position's cos and sin at `angles`, each op rounded to x's dtype as torch's."""
    dtype = x1.dtype
    cos1, cos2 = tl.load(angles + index), tl.load(angles + HALF + index)
    sin1, sin2 = tl.load(angles + 2 * HALF + index), tl.load(angles + 3 * HALF + index)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (((a * cos1).to(dtype).to(tl.float32) + (-b * sin1).to(dtype).to(tl.float32)).to(dtype),
            ((b * cos2).to(dtype).to(tl.float32) + (a * sin2).to(dtype).to(tl.float32)).to(dtype))


@triton.jit
def _rotate_store(x1, x2, head, index, row, table, positions, slot_blocks, slot_offsets, q_out, cache, block_stride,
                  value_offset, token_stride, HEADS, KV_HEADS, HALF: tl.constexpr):
    """Values of one head of row: x1 at `index` of its first half, x2 at index + HALF. Queries and
    keys rotated by the row's position; queries stored into q_out, keys and values into their
    cache slot."""
    if head < HEADS + KV_HEADS:
        x1, x2 = _rotated(x1, x2, table + tl.load(positions + row) * 4 * HALF, index, HALF)
    if head < HEADS:
        target = q_out + (row * HEADS + head) * 2 * HALF
    else:
        kv_index = head - HEADS   # keys 0 .. KV_HEADS - 1, then values
        slot = (tl.load(slot_blocks + row) * block_stride + tl.load(slot_offsets + row) * token_stride
                + (kv_index // KV_HEADS) * value_offset + (kv_index % KV_HEADS) * 2 * HALF)
        target = cache + slot
    tl.store(target + index, x1)
    tl.store(target + HALF + index, x2)


@triton.jit
def _silu_mul(gate_up, out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up + row * 2 * inter + cols, mask=ok, other=0.0)
    up = tl.load(gate_up + row * 2 * inter + inter + cols, mask=ok, other=0.0)
    tl.store(out + row * inter + cols, _silu_times(gate, up), mask=ok)


@triton.jit
def _silu_times(gate, up):
    """silu(gate) * up in gate's dtype, rounded where torch rounds: silu as x / (1 + exp(-x)) in
    float32, then the product."""
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


ROW_PRODUCT_MOST_OUTPUTS = 8192
ROW_PRODUCT_TILE = dict(BLOCK_N=8, BLOCK_K=512, STAGES=3, num_warps=4)   # the fastest of a sweep on an H200
NORMED_MOST_INPUTS = 8192   # a normed row product holds the whole row at once


@triton.jit
def _row_product(x, weight, y, n, k, delta, norm_weight, residual_out, eps, table, positions, slot_blocks,
                 slot_offsets, cache, block_stride, value_offset, token_stride, NORMED: tl.constexpr,
                 HAS_DELTA: tl.constexpr, ROW: tl.constexpr, ROPE: tl.constexpr,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """y = x' . weight^T for one row: x' is x, or with NORMED the RMSNorm of x (+ delta) by
    norm_weight, its scale from the whole row first, each value rounded where add_rms_norm rounds
    (the same x' as add_rms_norm's, so the same sums). With ROPE the outputs are a q/k/v row: a
    program takes BLOCK_N // 2 values of a head's first half and the ones HALF after them, and
    stores them as rope_store does (y is then the queries)."""
    program = tl.program_id(0)
    if ROPE:
        head = program // (HALF // (BLOCK_N // 2))
        first = program % (HALF // (BLOCK_N // 2)) * (BLOCK_N // 2)
        r = tl.arange(0, BLOCK_N)
        outs = head * 2 * HALF + first + r % (BLOCK_N // 2) + r // (BLOCK_N // 2) * HALF
    else:
        outs = program * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = outs < n
    inverse = 0.0
    if NORMED:   # add_rms_norm's scale of the row; the first program keeps the sum
        row = tl.arange(0, ROW)
        whole = _summed(x, delta, row, row < k, HAS_DELTA)
        if HAS_DELTA and program == 0:
            tl.store(residual_out + row, whole, mask=row < k)
        inverse = _rms_inverse(whole, k, eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for start in tl.range(0, k, BLOCK_K, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < k
        if NORMED:
            part = _summed(x, delta, cols, col_ok, HAS_DELTA)
            a = _normed(part, inverse, tl.load(norm_weight + cols, mask=col_ok, other=0.0)).to(part.dtype)
        else:
            a = tl.load(x + cols, mask=col_ok, other=0.0)
        w = tl.load(weight + outs[:, None].to(tl.int64) * k + cols[None, :], mask=out_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    values = tl.sum(acc, axis=1).to(y.dtype.element_ty)
    if ROPE:
        x1, x2 = tl.split(tl.permute(tl.reshape(values, (2, BLOCK_N // 2)), (1, 0)))
        _rotate_store(x1, x2, head, first + tl.arange(0, BLOCK_N // 2), 0, table, positions, slot_blocks,
                      slot_offsets, y, cache, block_stride, value_offset, token_stride, HEADS, KV_HEADS, HALF)
    else:
        tl.store(y + outs, values, mask=out_ok)


@dataclass(frozen=True)
class RopeStore:
    """rope_store's operands, for a q/k/v product that rotates and stores its own outputs."""
    heads: int
    kv_heads: int
    head_dim: int
    table: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    kv_cache: torch.Tensor


@dataclass(frozen=True)
class NormInput:
    """add_rms_norm's operands, for a row product that normalises its own input row: x + delta
    (delta None: x) normed by weight; the sum written to summed."""
    delta: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    summed: torch.Tensor


def row_product(x: torch.Tensor, weight: torch.Tensor, norm: NormInput | None = None,
                rope: RopeStore | None = None) -> torch.Tensor:
    """F.linear(x', weight) of one row by weight [n, k], both 16-bit and contiguous: the sums in
    float32, rounded once. x' is x [1, k], or with norm add_rms_norm's output for x. With rope,
    returns rope_store's queries [1, heads, head_dim] of the product, its keys and values stored."""
    n, k = weight.shape
    if rope is None:   # x stands in for the pointers a form does not read
        y = torch.empty(1, n, dtype=x.dtype, device=x.device)
        rope_operands, heads, kv_heads, half = (x, x, x, x, x, 0, 0, 0), 1, 1, 1
    else:
        y = torch.empty(1, rope.heads, rope.head_dim, dtype=x.dtype, device=x.device)
        rope_operands = (rope.table, rope.positions, rope.slot_blocks, rope.slot_offsets, rope.kv_cache,
                         *rope.kv_cache.stride()[:3])
        heads, kv_heads, half = rope.heads, rope.kv_heads, rope.head_dim // 2
    norm_operands = (x, x, x, 0.0) if norm is None else (x if norm.delta is None else norm.delta, norm.weight,
                                                         norm.summed, norm.eps)
    _row_product[(triton.cdiv(n, ROW_PRODUCT_TILE["BLOCK_N"]),)](
        x, weight, y, n, k, *norm_operands, *rope_operands, NORMED=norm is not None,
        HAS_DELTA=norm is not None and norm.delta is not None, ROW=triton.next_power_of_2(k) if norm else 1,
        ROPE=rope is not None, HEADS=heads, KV_HEADS=kv_heads, HALF=half, **ROW_PRODUCT_TILE)
    return y


def _one_row(x: torch.Tensor, weight, bias) -> bool:
    """Whether x [1, k] by weight runs as a Triton row product (16-bit, not too many outputs)."""
    return (bias is None and isinstance(weight, torch.Tensor) and x.shape[0] == 1 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and weight.shape[0] <= ROW_PRODUCT_MOST_OUTPUTS
            and x.is_contiguous() and weight.is_contiguous())


def supports(head_dim: int, kv_cache_strides: tuple[int, ...]) -> bool:
    """Whether the attention and rope kernels run this layout: a power-of-two head size of 16 or
    more (a tile's columns), each token's head dims contiguous in the cache."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and kv_cache_strides[-1] == 1


class CudaKernels(TorchKernels):
    """TorchKernels with the kernels above; prefill chunks keep torch's gather and SDPA (a chunk's
    many queries amortise the copy). Same weights' form as torch's."""
    name = "cuda"

    def linear(self, x, weight, bias=None):
        if _one_row(x, weight, bias):
            return row_product(x, weight)
        return super().linear(x, weight, bias)

    def attention_inputs(self, residual, delta, norm_weight, eps, weight, bias, heads, kv_heads, head_dim, table,
                         positions, slot_blocks, slot_offsets, kv_cache):
        """At one row one kernel: the norm from the whole row, the q/k/v product, rope_store's
        rotation and stores; the residual's sum out of place (the first program writes it while the
        others read the old one)."""
        if not (_one_row(residual, weight, bias) and residual.shape[1] <= NORMED_MOST_INPUTS
                and (delta is None or delta.is_contiguous()) and supports(head_dim, kv_cache.stride())
                and head_dim // 2 % (ROW_PRODUCT_TILE["BLOCK_N"] // 2) == 0):
            return super().attention_inputs(residual, delta, norm_weight, eps, weight, bias, heads, kv_heads,
                                            head_dim, table, positions, slot_blocks, slot_offsets, kv_cache)
        summed = torch.empty_like(residual) if delta is not None else residual
        rope = RopeStore(heads, kv_heads, head_dim, table, positions, slot_blocks, slot_offsets, kv_cache)
        return summed, row_product(residual, weight, NormInput(delta, norm_weight, eps, summed), rope)

    def add_rms_norm(self, residual, delta, weight, eps):
        """In place: residual becomes residual + delta."""
        rows, size = residual.shape
        residual = residual.contiguous()
        out = torch.empty_like(residual)
        _add_rms_norm[(rows,)](residual, delta.contiguous() if delta is not None else residual, weight, out, size,
                               eps, HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(size),
                               num_warps=4 if size <= 4096 else 8)
        return residual, out

    def rope_store(self, qkv, heads, kv_heads, head_dim, table, positions, slot_blocks, slot_offsets, kv_cache):
        if not supports(head_dim, kv_cache.stride()) or qkv.stride(1) != 1:
            return super().rope_store(qkv, heads, kv_heads, head_dim, table, positions, slot_blocks, slot_offsets,
                                      kv_cache)
        q = torch.empty(qkv.shape[0], heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        _rope_store[(qkv.shape[0], heads + 2 * kv_heads)](
            qkv, table, positions, slot_blocks, slot_offsets, q, kv_cache, qkv.stride(0), kv_cache.stride(0),
            kv_cache.stride(1), kv_cache.stride(2), HEADS=heads, KV_HEADS=kv_heads, HALF=head_dim // 2)
        return q

    def silu_mul(self, gate_up):
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        gate_up = gate_up.contiguous()
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        _silu_mul[(rows, triton.cdiv(inter, 1024))](gate_up, out, inter, BLOCK=1024)
        return out

    def decode_attention(self, q, kv_cache, group, scale):
        if not supports(q.shape[2], kv_cache.stride()):
            return super().decode_attention(q, kv_cache, group, scale)
        return decode_attention(q, kv_cache, group.block_table, group.context_lens, scale)

"""A Llama-family model's whole decode step, embedding to logits, as one persistent Triton kernel
for batches of up to MOST_ROWS sequences.

Why: replayed from a CUDA graph, a step of the layer-by-layer kernels (cuda_kernels.py) is still
about eight kernels a layer, and each costs its launch and a tail where the card's memory idles
while its last programs finish. Here one program per multiprocessor walks every stage of every
layer, and the programs meet at a barrier in global memory between stages (about a microsecond
each). engine.decode_kernel = auto times it against the graph per batch size and keeps the faster:
its products read each program's share of a matrix one tile at a time, waiting on memory for each,
where the graph's many programs per multiprocessor keep more bytes in flight.

A layer's stages, each shared out among the programs:
1. the q/k/v rows, of the input norm of residual + delta (each program takes the rows' scale
   from the whole rows; program 0 keeps the sum in the other residual buffer);
2. attention, one item per (sequence, KV head, split of its context): the item rotates its query
   heads; the one whose split holds the new token rotates its key and stores key and value into
   the cache slot; the last split of a (sequence, KV head) to finish merges the partial sums;
3. the o rows: attention's delta;
4. gate and up rows in pairs, of the norm of residual + that delta, and silu(gate) * up;
5. the down rows: the next layer's delta.
Then the final norm and the LM head's rows, as float32 logits rounded to the model dtype first.
Every value is rounded where cuda_kernels' kernels round it (torch's points), so tokens are the
graph path's; sums may run in another order.

The barrier counts arrivals in one int32 that the step's last program to leave sets back to 0.
All programs must be resident at once: the grid is the multiprocessor count. Under Triton's
interpreter (TRITON_INTERPRET=1, the CPU twin the tests run) the grid is one program, which
passes every barrier alone.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mcpd.kernels.cuda_kernels import _attend, _merge, _normed, _rotate_store, _rotated, _silu_times, _split_chunk
from mcpd.models.architecture import LlamaArgs

MOST_ROWS = 8      # the largest batch the kernel runs; larger ones replay the layer-by-layer graph
LAYER_POINTERS = tl.constexpr(8)   # per layer: q/k/v, o, gate/up, down, input norm, post norm, KV cache, q/k/v bias
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _grid_sync(barrier, target):
    """Wait until `target` arrivals have been counted: every program's at this barrier."""
    tl.debug_barrier()
    tl.atomic_add(barrier, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(barrier, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = tl.atomic_add(barrier, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _leave(barrier, programs):
    """The last program out sets the barrier's two counters back to 0 for the next step: by then
    every program has left its last wait."""
    tl.debug_barrier()
    if tl.atomic_add(barrier + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.atomic_xchg(barrier, 0)
        tl.atomic_xchg(barrier + 1, 0)


@triton.jit
def _share(n, program, programs):
    """This program's rows of n, [first, last): n / programs of them, rounded down or up."""
    return program * n // programs, (program + 1) * n // programs


@triton.jit
def _summed(x, delta, at, ok):
    """x + delta at `at`, rounded to x's dtype as torch's addition rounds it; read past L1."""
    values = tl.load(x + at, mask=ok, other=0.0, cache_modifier=".cg")
    more = tl.load(delta + at, mask=ok, other=0.0, cache_modifier=".cg")
    return (values.to(tl.float32) + more.to(tl.float32)).to(values.dtype)


@triton.jit
def _scales(x, delta, summed, eps, program, k, M: tl.constexpr, BB: tl.constexpr, BLOCK_K: tl.constexpr):
    """[M] RMSNorm scales of the rows x + delta [BB, k] (rows past BB: 1); program 0 stores the
    sums into summed."""
    batch = tl.arange(0, M)
    squares = tl.zeros((M, BLOCK_K), tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        at = batch[:, None] * k + cols[None, :]
        ok = (batch[:, None] < BB) & (cols[None, :] < k)
        values = _summed(x, delta, at, ok)
        if program == 0:
            tl.store(summed + at, values, mask=ok)
        squares += values.to(tl.float32) * values.to(tl.float32)
    return tl.rsqrt(tl.sum(squares, axis=1) / k + eps)


@triton.jit
def _inputs(x, delta, norm, scales, cols, k, M: tl.constexpr, BB: tl.constexpr, NORMED: tl.constexpr):
    """[M, BLOCK_K] of the product's input rows at cols (rows past BB: 0): x, or the norm of x + delta."""
    batch = tl.arange(0, M)
    at = batch[:, None] * k + cols[None, :]
    ok = (batch[:, None] < BB) & (cols[None, :] < k)
    if NORMED:
        values = _summed(x, delta, at, ok)
        weight = tl.load(norm + cols, mask=cols < k, other=0.0)
        values = _normed(values, scales[:, None], weight[None, :]).to(values.dtype)
    else:
        values = tl.load(x + at, mask=ok, other=0.0, cache_modifier=".cg")
    return values


@triton.jit
def _tile(x, delta, norm, scales, weight, rows, row_ok, k, M: tl.constexpr, BB: tl.constexpr, NORMED: tl.constexpr,
          ROWS: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """[M, ROWS] float32 sums: the input rows times weight's rows `rows` (of k columns). One input
    row: products kept per column, summed once at the end; more: a dot (M >= 16 rows, those past
    BB zero), faster than a weight tile reused row by row."""
    if BB == 1:
        acc = tl.zeros((ROWS, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((M, ROWS), tl.float32)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        a = _inputs(x, delta, norm, scales, cols, k, M, BB, NORMED)
        w = tl.load(weight + rows[:, None].to(tl.int64) * k + cols[None, :],
                    mask=row_ok[:, None] & (cols < k)[None, :], other=0.0, eviction_policy="evict_first")
        if BB == 1:
            acc += w.to(tl.float32) * a.to(tl.float32)
        elif IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if BB == 1:
        sums = tl.sum(acc, axis=1)[None, :]
    else:
        sums = acc
    return sums


@triton.jit
def _rows_stage(x, delta, norm, summed, eps, weight, bias, y, n, k, program, programs, M: tl.constexpr,
                BB: tl.constexpr, NORMED: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """y [BB, n] = input . weight^T (+ bias) over this program's rows, ROWS at a time, each value
    rounded to x's dtype once (then stored in y's: float32 for the logits). GATED: weight holds
    2n rows, gate then up, and y is silu(gate) * up."""
    first, last = _share(n, program, programs)
    scales = tl.zeros((M,), tl.float32)
    if NORMED:
        scales = _scales(x, delta, summed, eps, program, k, M, BB, BLOCK_K)
    batch = tl.arange(0, M)
    for start in range(first, last, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_ok = rows < last
        values = _tile(x, delta, norm, scales, weight, rows, row_ok, k, M, BB, NORMED, ROWS, BLOCK_K, IEEE)
        if GATED:
            up = _tile(x, delta, norm, scales, weight, n + rows, row_ok, k, M, BB, NORMED, ROWS, BLOCK_K, IEEE)
            values = _silu_times(values.to(x.dtype.element_ty), up.to(x.dtype.element_ty))
        if BIAS:
            values += tl.load(bias + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y + batch[:, None] * n + rows[None, :], values.to(x.dtype.element_ty).to(y.dtype.element_ty),
                 mask=(batch[:, None] < BB) & row_ok[None, :])


@triton.jit
def _attention_stage(qkv, queries, attended, partial_acc, partial_best, partial_total, merges, cache, rope,
                     positions, slot_blocks, slot_offsets, table, table_stride, context_lens, block_stride,
                     value_offset, token_stride, block_size, scale, program, programs, BB: tl.constexpr,
                     HEADS, KV_HEADS, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                     GROUP_TILE: tl.constexpr, TOKENS: tl.constexpr, IEEE: tl.constexpr):
    """attended [BB, HEADS * HEAD_DIM]: each sequence's new token against its context, its key and
    value stored first (stage 2 of the docstring)."""
    GROUP = HEADS // KV_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    for item in range(program, BB * KV_HEADS * SPLITS, programs):
        seq = item // (KV_HEADS * SPLITS)
        kv_head = item // SPLITS % KV_HEADS
        split = item % SPLITS
        _rotate_queries(qkv, width, queries, rope, positions, seq, kv_head, GROUP, HEADS, GROUP_TILE, HALF)
        if split == (tl.load(context_lens + seq) - 1) // _split_chunk(tl.load(context_lens + seq), SPLITS, TOKENS):
            for kind in range(2):   # the key, then the value
                _rotate_pair(qkv, width, HEADS + kind * KV_HEADS + kv_head, half, seq, rope, positions, slot_blocks,
                             slot_offsets, queries, cache, block_stride, value_offset, token_stride, HEADS,
                             KV_HEADS, HALF)
        tl.debug_barrier()
        _attend(queries, cache, table, context_lens, attended, partial_acc, partial_best, partial_total,
                HEADS * HEAD_DIM, HEADS * HEAD_DIM, block_stride, value_offset, token_stride, table_stride,
                block_size, scale, seq, kv_head, KV_HEADS, split, GROUP, GROUP_TILE, HEAD_DIM, TOKENS, SPLITS,
                IEEE)
        if SPLITS > 1:
            tl.debug_barrier()
            merge = merges + seq * KV_HEADS + kv_head
            if tl.atomic_add(merge, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:   # the last split here
                _merge(partial_acc, partial_best, partial_total, attended, HEADS * HEAD_DIM, seq, kv_head, HEADS,
                       GROUP, GROUP_TILE, HEAD_DIM, SPLITS)
                tl.atomic_xchg(merge, 0)


@triton.jit
def _rotate_queries(qkv, width, queries, rope, positions, seq, kv_head, GROUP, HEADS, GROUP_TILE: tl.constexpr,
                    HALF: tl.constexpr):
    """A KV head's query heads of a sequence's q/k/v row, rotated and stored into `queries`."""
    members = tl.arange(0, GROUP_TILE)
    ok = members[:, None] < GROUP
    half = tl.arange(0, HALF)
    heads = kv_head * GROUP + members
    source = qkv + seq * width + heads[:, None] * 2 * HALF + half[None, :]
    x1, x2 = _rotated(tl.load(source, mask=ok, other=0.0, cache_modifier=".cg"),
                      tl.load(source + HALF, mask=ok, other=0.0, cache_modifier=".cg"),
                      rope + tl.load(positions + seq) * 4 * HALF, half, HALF)
    target = queries + (seq * HEADS + heads[:, None]) * 2 * HALF + half[None, :]
    tl.store(target, x1, mask=ok)
    tl.store(target + HALF, x2, mask=ok)


@triton.jit
def _rotate_pair(qkv, width, head, half, seq, rope, positions, slot_blocks, slot_offsets, queries, cache,
                 block_stride, value_offset, token_stride, HEADS, KV_HEADS, HALF: tl.constexpr):
    """One head of a sequence's q/k/v row rotated (queries and keys) and stored: queries into
    `queries`, keys and values into the cache slot (cuda_kernels' _rotate_store)."""
    source = qkv + seq * width + head * 2 * HALF
    _rotate_store(tl.load(source + half, cache_modifier=".cg"), tl.load(source + HALF + half, cache_modifier=".cg"),
                  head, half, seq, rope, positions, slot_blocks, slot_offsets, queries, cache, block_stride,
                  value_offset, token_stride, HEADS, KV_HEADS, HALF)


@triton.jit
def _embed(ids, embedding, residual, delta, program, programs, hidden, BB: tl.constexpr, BLOCK_K: tl.constexpr):
    """The step's input rows: residual = the tokens' embedding rows, delta = 0."""
    for seq in range(program, BB, programs):
        token = tl.load(ids + seq)
        for start in range(0, hidden, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            ok = cols < hidden
            tl.store(residual + seq * hidden + cols, tl.load(embedding + token * hidden + cols, mask=ok), mask=ok)
            tl.store(delta + seq * hidden + cols, tl.zeros((BLOCK_K,), delta.dtype.element_ty), mask=ok)


@triton.jit
def _decode_step(ids, positions, slot_blocks, slot_offsets, context_lens, table, table_stride, rope, layers,
                 num_layers, embedding, final_norm, head, vocab, residual, delta, attention_delta, qkv, queries,
                 attended, act, partial_acc, partial_best, partial_total, merges, logits, barrier, eps, scale,
                 block_stride, value_offset, token_stride, block_size, HIDDEN, INTER, HEADS, KV_HEADS,
                 BB: tl.constexpr, M: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                 GROUP_TILE: tl.constexpr, TOKENS: tl.constexpr, QKV_ROWS: tl.constexpr, O_ROWS: tl.constexpr,
                 MLP_ROWS: tl.constexpr, DOWN_ROWS: tl.constexpr, HEAD_ROWS: tl.constexpr, QKV_K: tl.constexpr,
                 O_K: tl.constexpr, MLP_K: tl.constexpr, DOWN_K: tl.constexpr, HEAD_K: tl.constexpr,
                 QKV_BIAS: tl.constexpr, IEEE: tl.constexpr):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = embedding.dtype.element_ty
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    other = residual + BB * HIDDEN   # the residual's second buffer: a stage's sum goes where nobody reads
    _embed(ids, embedding, residual, delta, program, programs, HIDDEN, BB, QKV_K)
    arrivals = programs
    _grid_sync(barrier, arrivals)
    for layer in range(num_layers):
        at = layers + layer * LAYER_POINTERS
        w_qkv, w_o = tl.load(at).to(tl.pointer_type(dtype)), tl.load(at + 1).to(tl.pointer_type(dtype))
        w_gate_up, w_down = tl.load(at + 2).to(tl.pointer_type(dtype)), tl.load(at + 3).to(tl.pointer_type(dtype))
        input_norm, post_norm = tl.load(at + 4).to(tl.pointer_type(dtype)), tl.load(at + 5).to(tl.pointer_type(dtype))
        cache, qkv_bias = tl.load(at + 6).to(tl.pointer_type(dtype)), tl.load(at + 7).to(tl.pointer_type(dtype))
        _rows_stage(residual, delta, input_norm, other, eps, w_qkv, qkv_bias, qkv, width, HIDDEN, program, programs,
                    M, BB, True, QKV_BIAS, False, QKV_ROWS, QKV_K, IEEE)
        arrivals += programs
        _grid_sync(barrier, arrivals)
        _attention_stage(qkv, queries, attended, partial_acc, partial_best, partial_total, merges, cache, rope,
                         positions, slot_blocks, slot_offsets, table, table_stride, context_lens, block_stride,
                         value_offset, token_stride, block_size, scale, program, programs, BB, HEADS, KV_HEADS,
                         HEAD_DIM, SPLITS, GROUP_TILE, TOKENS, IEEE)
        arrivals += programs
        _grid_sync(barrier, arrivals)
        _rows_stage(attended, attended, attended, attended, eps, w_o, w_o, attention_delta, HIDDEN,
                    HEADS * HEAD_DIM, program, programs, M, BB, False, False, False, O_ROWS, O_K, IEEE)
        arrivals += programs
        _grid_sync(barrier, arrivals)
        _rows_stage(other, attention_delta, post_norm, residual, eps, w_gate_up, w_gate_up, act, INTER, HIDDEN,
                    program, programs, M, BB, True, False, True, MLP_ROWS, MLP_K, IEEE)
        arrivals += programs
        _grid_sync(barrier, arrivals)
        _rows_stage(act, act, act, act, eps, w_down, w_down, delta, HIDDEN, INTER, program, programs, M, BB, False,
                    False, False, DOWN_ROWS, DOWN_K, IEEE)
        arrivals += programs
        _grid_sync(barrier, arrivals)
    _rows_stage(residual, delta, final_norm, other, eps, head, head, logits, vocab, HIDDEN, program, programs, M, BB,
                True, False, False, HEAD_ROWS, HEAD_K, IEEE)
    _leave(barrier, programs)


def decode_step_for(model, batch: int) -> DecodeStep | None:
    """The kernel's operands for `model` at `batch` sequences, or None where it does not run them
    (the layer-by-layer kernels do): see refusal."""
    return None if batch > MOST_ROWS or refusal(model) else DecodeStep(model, batch)


def refusal(model) -> str | None:
    """Why the kernel does not run `model`, or None: it runs the Llama family's plain layers
    (RMSNorm, rotary positions of a fixed table, SiLU gate) in 16-bit or float32 weights as plain
    tensors, without biases, q/k norms, experts or sliding windows."""
    args = getattr(model, "args", None)
    if not isinstance(args, LlamaArgs) or getattr(model, "rope", None) is None:
        return "not a Llama-family model"
    features = {"a sliding window": args.sliding_window, "q/k norms": args.qk_norm, "experts": args.num_experts,
                "length-dependent rope": model.rope.by_length}
    present = [name for name, value in features.items() if value]
    if present:
        return present[0]
    weights = model.weights
    tensors = [weights.embedding, weights.final_norm, weights.head] + [
        getattr(w, name) for w in weights.layers for name in PLAIN if getattr(w, name) is not None]
    dtype = weights.final_norm.dtype
    if not all(isinstance(t, torch.Tensor) and t.dtype == dtype and t.is_contiguous() for t in tensors):
        return "weights not plain contiguous tensors of one dtype (quantized or in parts)"
    if any(getattr(w, name) is not None for w in weights.layers for name in BIASES):
        return "biases past the q/k/v product's"
    if any((w.qkv_bias is None) != (weights.layers[0].qkv_bias is None) for w in weights.layers):
        return "a q/k/v bias in some layers only"
    cache = weights.layers[0].attention.kv_cache
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or cache is None or cache.dtype != dtype:
        return f"{dtype} weights, or a KV cache of another dtype"
    if args.head_dim < 16 or args.head_dim & (args.head_dim - 1) or cache.stride(-1) != 1:
        return "a head size that is not a power of two of 16 or more"
    return None


PLAIN = ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "qkv_bias")   # qkv_bias: None or run
BIASES = ("o_bias", "gate_up_bias", "down_bias")   # not run


class DecodeStep:
    """The kernel's operands for one batch size: its buffers, and each layer's weights' and cache's
    addresses in one table. Built once per batch size a CUDA graph is captured for; the weights
    must not move after (the engine never moves them)."""

    def __init__(self, model, batch: int, tile: dict | None = None) -> None:
        weights, args = model.weights, model.args
        self.model, self.batch, self.args = model, batch, args
        self.weights = weights
        first = weights.layers[0]
        device, dtype = first.qkv.device, first.qkv.dtype
        rows = [[w.qkv.data_ptr(), w.o.data_ptr(), w.gate_up.data_ptr(), w.down.data_ptr(), w.input_norm.data_ptr(),
                 w.post_norm.data_ptr(), w.attention.kv_cache.data_ptr(), 0 if w.qkv_bias is None else
                 w.qkv_bias.data_ptr()] for w in weights.layers]
        self.layers = torch.tensor([value for row in rows for value in row], dtype=torch.int64, device=device)
        hidden, heads, kv_heads, head_dim = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim
        self.programs = 1 if INTERPRETED else torch.cuda.get_device_properties(device).multi_processor_count
        self.tile = tile or (SMALL_TILE if INTERPRETED else TILE)
        # splits of each context: two items a program where the batch is small (cuda_kernels.split_count)
        self.splits = min(self.tile["MOST_SPLITS"],
                          triton.next_power_of_2(max(1, -(-2 * self.programs // (batch * kv_heads)))))

        def buffer(*shape, of=dtype):
            return torch.empty(*shape, dtype=of, device=device)
        self.residual, self.delta, self.attention_delta = buffer(2, batch, hidden), buffer(batch, hidden), \
            buffer(batch, hidden)
        self.qkv, self.queries = buffer(batch, (heads + 2 * kv_heads) * head_dim), buffer(batch, heads, head_dim)
        self.attended, self.act = buffer(batch, heads * head_dim), buffer(batch, args.intermediate_size)
        partials = batch * heads * self.splits
        self.partials = (buffer(partials * head_dim, of=torch.float32), buffer(partials, of=torch.float32),
                         buffer(partials, of=torch.float32))
        self.merges = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
        self.barrier = torch.zeros(2, dtype=torch.int32, device=device)
        self.logits = buffer(batch, weights.head.shape[0], of=torch.float32)
        stages = {"QKV": (self.qkv.shape[1], hidden), "O": (hidden, heads * head_dim),
                  "MLP": (args.intermediate_size, hidden), "DOWN": (hidden, args.intermediate_size),
                  "HEAD": (self.logits.shape[1], hidden)}   # each product's rows and columns
        self.shapes = {}
        for stage, (n, k) in stages.items():
            rows = self._rows(n)
            columns = min(self.tile["TILE"] // rows, triton.next_power_of_2(k))
            self.shapes |= {f"{stage}_ROWS": rows, f"{stage}_K": columns}

    def _rows(self, n: int) -> int:
        """A stage's tile height: every row of a program's share at once where that is at most
        MOST_TILE_ROWS (masked past it: masked loads read nothing), else that many at a time."""
        return max(16, min(MOST_TILE_ROWS, triton.next_power_of_2(-(-n // self.programs))))

    def logits_for(self, ids: torch.Tensor, attn) -> torch.Tensor:
        """[batch, vocab] float32 logits of one decode step: ids [batch] at attn's positions, their
        keys and values stored into the cache as forward stores them."""
        args, weights, cache = self.args, self.weights, self.weights.layers[0].attention.kv_cache
        first_bias = weights.layers[0].qkv_bias
        group = attn.groups[0]
        rope = self.model.rope.for_step(attn, weights.final_norm.dtype)[0]
        _decode_step[(self.programs,)](
            ids, attn.positions, attn.slot_blocks, attn.slot_offsets, group.context_lens, group.block_table,
            group.block_table.stride(0), rope, self.layers, len(weights.layers), weights.embedding, weights.final_norm,
            weights.head, weights.head.shape[0], self.residual, self.delta, self.attention_delta, self.qkv,
            self.queries, self.attended, self.act, *self.partials, self.merges, self.logits, self.barrier,
            args.rms_norm_eps, weights.layers[0].attention.scale, cache.stride(0), cache.stride(1), cache.stride(2),
            cache.shape[2], args.hidden_size, args.intermediate_size, args.num_heads, args.num_kv_heads,
            BB=self.batch, M=1 if self.batch == 1 else max(16, self.batch), HEAD_DIM=args.head_dim,
            SPLITS=self.splits, **self.shapes,
            GROUP_TILE=max(16, triton.next_power_of_2(args.num_heads // args.num_kv_heads)),
            QKV_BIAS=first_bias is not None, IEEE=weights.final_norm.dtype == torch.float32,
            **{name: value for name, value in self.tile.items() if name not in ("TILE", "MOST_SPLITS")})
        return self.logits


MOST_TILE_ROWS = 64
# TILE: weight elements a program loads at a time (rows x columns): its bytes in flight
TILE = dict(TOKENS=32, TILE=16384, MOST_SPLITS=16, num_warps=8)
SMALL_TILE = dict(TOKENS=16, TILE=4096, MOST_SPLITS=16, num_warps=4)   # the interpreter's: tiny test models

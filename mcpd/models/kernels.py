"""The compute kernels a Llama forward pass is made of, in two implementations with one interface.

TorchKernels: torch ops, on any device and dtype; the portable path (CUDA, float16, odd shapes,
no C compiler) and the reference the native kernels are tested against.
NativeKernels: the C kernels of kernels.c on the CPU, for float32 and bfloat16. Weight matrices
are packed once, at load, into the panels kernels.c multiplies (prepare()); the products of any
number of rows are native (faster than torch's GEMM at every row count on an AVX-512 CPU, see
kernels.c; on AVX2 they spill, so auto chooses torch there: choose()). Attention, of decoding
sequences and of prefill chunks, reads the paged KV cache in place; with the native kernels the
whole decoder stack runs as one call a step (native_stack.py).

Each op mirrors the order of roundings of transformers' Llama, so that both implementations
give transformers' greedy tokens in float32 and in bfloat16.

Weight-only int8 matrices (int8.py) run on both: the torch twin converts the integers at each
product (int8.linear), the native kernels read the int8 panels and convert in registers; on a
CUDA device the torch kernels multiply them with a Triton kernel that does the same (int8_cuda.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcpd import cpu_features
from mcpd.models import int8, native
from mcpd.models.int8 import Int8Weight

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
PANEL = 16


@dataclass(frozen=True, slots=True)
class Packed:
    """A weight matrix [n, k] in kernels.c's panel layout: float32 and int8 [n/16, k, 16],
    bfloat16 [n/16, k/2, 16, 2] (n padded with zero rows to a multiple of 16); an int8 one has
    its scales in panels too, float32 [n/16, groups(k), 16] (padding rows' scales 1)."""
    panels: torch.Tensor
    n: int
    k: int
    scales: torch.Tensor | None = None

    @classmethod
    def of(cls, weight: torch.Tensor | Int8Weight) -> Packed:
        if isinstance(weight, Int8Weight):
            packed = cls.of(weight.values)
            scales = F.pad(weight.scales, (0, 0, 0, -packed.n % PANEL), value=1.0)
            scales = scales.view(-1, PANEL, scales.shape[1]).transpose(1, 2).contiguous()
            return cls(packed.panels, packed.n, packed.k, scales)
        n, k = weight.shape
        padded = F.pad(weight, (0, 0, 0, -n % PANEL))
        if weight.dtype in (torch.float32, torch.int8):
            panels = padded.view(-1, PANEL, k).transpose(1, 2)
        else:
            panels = padded.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3)
        return cls(panels.contiguous(), n, k)


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

    def embedding(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, table)

    def linear(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, Int8Weight):
            if x.is_cuda:   # imported here: Triton comes with torch's CUDA builds, not the CPU ones
                from mcpd.models import int8_cuda
                return int8_cuda.linear(x, weight, bias)
            return int8.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def logits(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight) -> torch.Tensor:
        """float32 logits, rounded to the model dtype first as transformers' lm_head rounds them."""
        return self.linear(x, weight).float()

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token: logits.argmax(dim=-1), the first of equal maxima (a NaN counting
        as the largest) alike. On the CPU through numpy: torch's took 29 us over a 32000-token row
        against numpy's 3 us (its reduction's setup, measured on the issues' 2-vCPU machine)."""
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

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, group, scale: float) -> torch.Tensor:
        """One query per sequence, q [B, heads, D], over the first group.context_lens[i] tokens
        of the blocks group.block_table[i] of kv_cache (a layer's [blocks, 2, block_size,
        kv_heads, D]); returns [B, heads * D]."""
        batch, width = group.block_table.shape
        keys, values = _gather(kv_cache, group.block_table)
        mask = torch.arange(width * kv_cache.shape[2], device=q.device) < group.context_lens[:, None]
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask[:, None, None],
                                             scale=scale, enable_gqa=True)
        return out.flatten(1)

    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, group, scale: float) -> torch.Tensor:
        """The group's new tokens, q [rows, heads, D], each over its sequence's tokens up to
        itself (causal); returns [rows, heads * D]. Chunks are padded to the longest (group.mask
        keeps each query causal, group.output_rows drops the padding)."""
        keys, values = _gather(kv_cache, group.block_table)
        queries = q[group.query_index].transpose(1, 2)          # [B, heads, Q, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2).flatten(2).flatten(0, 1)[group.output_rows]


def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the blocks in block_table [B, W]: each [B, kv_heads, W * block_size, D].
    Whole blocks are contiguous runs of memory, and index_select copies them as such (several
    times faster on the CPU than the equivalent advanced indexing)."""
    batch, width = block_table.shape
    blocks = kv_cache.index_select(0, block_table.flatten())   # [B * W, 2, block_size, kv_heads, D]
    blocks = blocks.view(batch, width, 2, kv_cache.shape[2], *kv_cache.shape[3:])
    return tuple(blocks[:, :, i].flatten(1, 2).transpose(1, 2) for i in (0, 1))


class NativeKernels(TorchKernels):
    name = "native"
    form = f"panels16-int8group{int8.GROUP}"
    stacks_layers = True

    def __init__(self) -> None:
        self.lib = native.load()
        self.codes = _DTYPE_CODES
        if self.lib.mcpd_max_threads() != torch.get_num_threads():
            raise native.NativeUnavailable(
                f"the kernels see {self.lib.mcpd_max_threads()} OpenMP threads, torch "
                f"{torch.get_num_threads()}: they did not bind torch's OpenMP runtime")

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device, sizes: list[int], head_dim: int, group: int) -> bool:
        """Whether a model of these dtype, device, matrix sizes, head size and query heads per KV
        head runs here (the kernels work in 16-wide vectors, on head sizes up to 256)."""
        return (device.type == "cpu" and dtype in _DTYPE_CODES and all(s % 16 == 0 for s in sizes)
                and head_dim % 16 == 0 and head_dim <= 256 and group <= 16)

    def prepare(self, weight):
        return Packed.of(weight)

    def embedding(self, ids, table):
        if not isinstance(table, Packed):
            return self._rows(ids, table)
        out = torch.empty((ids.shape[0], table.k), dtype=table.panels.dtype)   # a tied LM head's rows
        self.lib.mcpd_embedding(self.codes[out.dtype], table.panels.data_ptr(), table.k, ids.data_ptr(),
                                ids.shape[0], out.data_ptr())
        return out

    def _rows(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """F.embedding(ids, table) of a plain table, in one native call (mcpd_rows says why)."""
        if not (table.is_contiguous() and ids.dtype == torch.long and ids.dim() == 1 and ids.is_contiguous()):
            return F.embedding(ids, table)
        out = table.new_empty((ids.shape[0], table.shape[1]))
        if self.lib.mcpd_rows(table.data_ptr(), out.stride(0) * out.element_size(), table.shape[0], ids.data_ptr(),
                              ids.shape[0], out.data_ptr()):
            raise IndexError("index out of range in self")   # F.embedding's words
        return out

    def linear(self, x, weight, bias=None):
        x = x.contiguous()
        return self._product(x, weight, bias, x.new_empty((x.shape[0], weight.n)), 0)

    def logits(self, x, weight):
        x = x.contiguous()   # the rows that sample, picked out of the step's hidden states
        return self._product(x, weight, None, torch.empty((x.shape[0], weight.n), dtype=torch.float32), 1)

    def argmax(self, logits):
        """TorchKernels.argmax in one native call (mcpd_argmax says what it saves)."""
        if logits.dtype != torch.float32:   # logits() gives float32; anything else, torch's way
            return super().argmax(logits)
        logits = logits.contiguous()
        tokens = torch.empty(logits.shape[0], dtype=torch.long)
        self.lib.mcpd_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], tokens.data_ptr())
        return tokens

    def _product(self, x: torch.Tensor, weight: Packed, bias: torch.Tensor | None, y: torch.Tensor,
                 y_f32: int) -> torch.Tensor:
        operands = (self.codes[x.dtype], x.data_ptr(), x.shape[0], weight.k, weight.panels.data_ptr())
        bias_address = bias.data_ptr() if bias is not None else None
        if weight.scales is None:
            self.lib.mcpd_linear(*operands, bias_address, weight.n, y.data_ptr(), y_f32)
        else:
            self.lib.mcpd_linear_int8(*operands, weight.scales.data_ptr(), bias_address, weight.n, y.data_ptr(),
                                      y_f32)
        return y

    def add_rms_norm(self, residual, delta, weight, eps):
        """In place: residual becomes residual + delta."""
        out = torch.empty_like(residual)
        self.lib.mcpd_add_rms_norm(self.codes[residual.dtype], residual.data_ptr(),
                                   None if delta is None else delta.contiguous().data_ptr(), weight.data_ptr(),
                                   eps, residual.shape[0], residual.shape[1], out.data_ptr())
        return residual, out

    def rope_store(self, qkv, heads, kv_heads, head_dim, table, positions, slot_blocks, slot_offsets, kv_cache):
        self.lib.mcpd_rope_store(self.codes[qkv.dtype], qkv.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim,
                                 positions.data_ptr(), table.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0),
                                 kv_cache.stride(1), slot_blocks.data_ptr(), slot_offsets.data_ptr())
        return qkv[:, :heads * head_dim].view(-1, heads, head_dim)

    def silu_mul(self, gate_up):
        inter = gate_up.shape[1] // 2
        out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
        self.lib.mcpd_silu_mul(self.codes[gate_up.dtype], gate_up.data_ptr(), gate_up.shape[0], inter,
                               out.data_ptr())
        return out

    def decode_attention(self, q, kv_cache, group, scale):
        batch, heads, head_dim = q.shape
        out = torch.empty(batch, heads * head_dim, dtype=q.dtype)
        self.lib.mcpd_decode_attention(self.codes[q.dtype], q.data_ptr(), q.stride(0), batch, heads, kv_cache.shape[3],
                                       head_dim, *_paged(kv_cache, group), group.context_lens.data_ptr(), scale,
                                       out.data_ptr())
        return out

    def prefill_attention(self, q, kv_cache, group, scale):
        rows, heads, head_dim = q.shape
        out = torch.empty(rows, heads * head_dim, dtype=q.dtype)
        self.lib.mcpd_prefill_attention(self.codes[q.dtype], q.data_ptr(), q.stride(0), group.block_table.shape[0],
                                        group.first_rows.data_ptr(), group.starts.data_ptr(), group.counts.data_ptr(),
                                        heads, kv_cache.shape[3], head_dim, *_paged(kv_cache, group), scale,
                                        out.data_ptr())
        return out


def _cuda_kernels() -> tuple[TorchKernels, str]:
    """On a CUDA device: torch's kernels with the paged decode attention in Triton (cuda_kernels.py);
    torch's alone where Triton is missing (it comes with torch's CUDA builds, not every install)."""
    try:
        from mcpd.models.cuda_kernels import CudaKernels
    except ImportError as e:
        return TORCH, f"torch kernels (no Triton for the CUDA ones: {e})"
    return CudaKernels(), "cuda kernels (torch's products, fused layer ops and paged decode attention in Triton)"


def _paged(kv_cache: torch.Tensor, group) -> tuple[int, ...]:
    """A layer's paged cache and a group's block tables as the attention kernels take them: base
    address, block stride, offset of values after keys, block size, tables, table stride."""
    table = group.block_table
    return (kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[2], table.data_ptr(),
            table.stride(0))


TORCH = TorchKernels()


def choose(requested: str, dtype: torch.dtype, device: torch.device, sizes: list[int], head_dim: int,
           group: int) -> tuple[TorchKernels, str]:
    """The kernels for engine.kernels = requested (auto, native, torch), and why, for the log.
    auto takes native where it supports the model, builds here and the CPU has AVX-512, else
    torch; native refuses (NativeUnavailable) where it cannot run."""
    if requested == "torch":
        return TORCH, "engine.kernels = torch"
    if requested == "auto" and device.type == "cuda":
        return _cuda_kernels()
    if requested == "auto" and device.type == "cpu" and not cpu_features.has("avx512f"):
        # The product tiles hold their sums in 32 AVX-512 registers; with AVX2's 16 they spill:
        # on an AVX2 EPYC a 128-token prefill took 1.5 s against torch's (MKL) 0.14 s, and batched
        # decode was as slow, for 12% more batch-1 decode. bench/engine.py --kernels native shows it.
        return TORCH, "torch kernels (the native ones want AVX-512; this CPU has none)"
    if not NativeKernels.supports(dtype, device, sizes, head_dim, group):
        reason = f"native kernels do not support {dtype} on {device.type} with these sizes"
        if requested == "native":
            raise native.NativeUnavailable(reason)
        return TORCH, reason
    try:
        return NativeKernels(), "native kernels"
    except (native.NativeUnavailable, OSError) as e:
        if requested == "native":
            raise native.NativeUnavailable(str(e)) from None
        return TORCH, f"native kernels unavailable ({e})"


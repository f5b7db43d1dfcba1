"""The C kernels of kernels.c on the CPU, for float32 and bfloat16, behind TorchKernels' interface.

Weight matrices are packed once, at load, into the panels kernels.c multiplies (prepare()); the
products of any number of rows are native. Attention, of decoding sequences and of prefill
chunks, reads the paged KV cache in place; the whole decoder stack runs as one call a step
(native_stack.py). Weight-only int8 and 4-bit matrices are read as such and converted in registers
(int8 ones multiplied by activations rounded to int16, as int8.linear does).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mcpd.kernels import native
from mcpd.kernels.torch_kernels import TorchKernels
from mcpd.quant.int4 import Int4Weight
from mcpd.quant.int4_layout import BLOCK
from mcpd.quant.int8 import Int8Weight
from mcpd.quant.int8_layout import group_of

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
PANEL = 16


@dataclass(frozen=True, slots=True)
class Packed:
    """A weight matrix [n, k] in kernels.c's panel layout: float32 [n/16, k, 16], bfloat16 and
    int8 [n/16, k/2, 16, 2] (each output's consecutive inputs side by side, the pairs the
    bfloat16 dot product and vpmaddwd take; n padded with zero rows to a multiple of 16); an int8 one has
    its scales in panels too, float32 [n/16, groups(k), 16] (padding rows' scales 1); a 4-bit
    one is bytes [n/16, k/32, 4, 16, 4] (int4.py's bytes of a block, four of each of 16 rows
    at a time), its scales and (Q4_1) mins float16 [n/16, k/32, 16] (Q4_K: uint8, and supers
    float16 [n/16, k/256, 2, 16]; Q6_K: scales int8 [n/16, k/16, 16], highs [n/16, k/32, 2, 16, 4],
    supers [n/16, k/256, 1, 16]; the AVX2 set's Q6_K values and highs: _six_bit_ends)."""
    panels: torch.Tensor
    n: int
    k: int
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    supers: torch.Tensor | None = None
    highs: torch.Tensor | None = None

    @classmethod
    def of(cls, weight: torch.Tensor | Int8Weight | Int4Weight, six_bit_ends: bool = False) -> Packed:
        """six_bit_ends: Q6_K in the AVX2 set's arrangement (_six_bit_ends)."""
        if isinstance(weight, Int4Weight):
            return cls._of_int4(weight, six_bit_ends)
        if isinstance(weight, Int8Weight):
            if weight.values.shape[1] % 2:
                raise ValueError(f"an int8 matrix of {weight.values.shape[1]} columns: the native kernels take pairs")
            packed = cls.of(weight.values)
            scales = F.pad(weight.scales, (0, 0, 0, -packed.n % PANEL), value=1.0)
            scales = scales.view(-1, PANEL, scales.shape[1]).transpose(1, 2).contiguous()
            return cls(packed.panels, packed.n, packed.k, scales)
        n, k = weight.shape
        padded = F.pad(weight, (0, 0, 0, -n % PANEL))
        if weight.dtype == torch.float32:
            panels = padded.view(-1, PANEL, k).transpose(1, 2)
        else:
            panels = padded.view(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3)
        return cls(panels.contiguous(), n, k)

    @classmethod
    def _of_int4(cls, weight: Int4Weight, six_bit_ends: bool) -> Packed:
        (n, k), pad = weight.shape, -weight.shape[0] % PANEL
        blocks = k // BLOCK
        if six_bit_ends and weight.highs is not None:
            weight = replace(weight, **_six_bit_ends(weight))
        panels = _in_quads(F.pad(weight.values, (0, 0, 0, pad)), blocks)
        scales, mins = (None if t is None else
                        F.pad(t, (0, 0, 0, pad)).view(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()
                        for t in (weight.scales, weight.mins))
        highs = None if weight.highs is None else _in_quads(F.pad(weight.highs, (0, 0, 0, pad)), blocks)
        supers = weight.supers
        if supers is not None:   # [n/16, k/256, 2 or 1, 16]
            supers = F.pad(supers, (0, 0, 0, 0, 0, pad)).view(-1, PANEL, *supers.shape[1:]).permute(0, 2, 3, 1).contiguous()
        return cls(panels, n, k, scales, mins, supers, highs)

    def matrix(self) -> native.Matrix:
        """The record kernels.c's products take."""
        if self.scales is None:
            kind, group = native.Matrix.PLAIN, 0
        elif self.panels.dtype == torch.int8:
            kind, group = native.Matrix.INT8, group_of(self.k, self.scales.shape[1])
        else:
            kind = (native.Matrix.Q6_K if self.highs is not None else native.Matrix.Q4_K if self.supers is not None
                    else native.Matrix.Q4_0 if self.mins is None else native.Matrix.Q4_1)
            group = BLOCK
        return native.Matrix(self.panels.data_ptr(), native.address(self.scales), native.address(self.mins), kind, group,
                             native.address(self.supers), native.address(self.highs))


def _six_bit_ends(weight: Int4Weight) -> dict[str, torch.Tensor]:
    """Q6_K's values and highs rearranged for the AVX2 kernels (kernels.c, q6_pair_avx2), bytes of the
    same shapes: in each 16-bit half of a quad's lane (columns c, c + 1, c + 16, c + 17 of the block,
    c = 4t + 2e) values holds c + 1 in bits 0-5, c's low nibble in 6-9 and c + 16 in 10-15; in each
    pair of quads' lanes (t = 2p, 2p + 1) highs holds c + 17 of quad 2p in bits 0-5, the top two bits
    of c of quad 2p in 6-7 and of quad 2p + 1 in 8-9, and c + 17 of quad 2p + 1 in 10-15."""
    n, blocks = weight.values.shape[0], weight.values.shape[1] // (BLOCK // 2)
    nibbles = weight.values.view(n, blocks, BLOCK // 2).int()
    tops = (weight.highs.view(n, blocks, 1, 8).int() >> torch.arange(0, 8, 2, device=weight.highs.device)[:, None]) & 3
    q = (torch.cat((nibbles & 15, nibbles >> 4), dim=2) + 16 * tops.reshape(n, blocks, BLOCK))
    q = q.view(n, blocks, 2, 4, 2, 2)   # [half of the block][quad t][e][column's parity]
    even, odd, high_even, high_odd = q[:, :, 0, ..., 0], q[:, :, 0, ..., 1], q[:, :, 1, ..., 0], q[:, :, 1, ..., 1]
    values = odd | (even & 15) << 6 | high_even << 10   # [n, blocks, t, e]
    tops = (even >> 4).view(n, blocks, 2, 2, 2)   # [pair][quad of the pair][e]
    high_odd = high_odd.view(n, blocks, 2, 2, 2)
    highs = high_odd[:, :, :, 0] | tops[:, :, :, 0] << 6 | tops[:, :, :, 1] << 8 | high_odd[:, :, :, 1] << 10
    as_bytes = lambda halves: torch.stack((halves & 255, halves >> 8), dim=-1).to(torch.uint8).view(n, -1)
    return {"values": as_bytes(values), "highs": as_bytes(highs)}


def _in_quads(block_bytes: torch.Tensor, blocks: int) -> torch.Tensor:
    """Bytes [n, blocks * 4c] as [n/16, blocks, c, 16, 4]: each row's four bytes side by side, a
    32-bit lane of the integer dot products (kernels.c, x_q16_dot)."""
    return block_bytes.view(-1, PANEL, blocks, block_bytes.shape[1] // blocks // 4, 4).permute(0, 2, 3, 1, 4).contiguous()


class NativeKernels(TorchKernels):
    form = "panels16-int8pairs-int4b32x4"   # every instruction set's tiles read these panels (AVX2: its own Q6_K)
    stacks_layers = True

    def __init__(self, isa: str) -> None:
        """isa: the instruction set they are built for (a key of native.ISAS); name says it."""
        self.name, self.isa = f"native-{isa}", isa
        if isa == "avx2":   # its own Q6_K arrangement: packed weights are not the AVX-512 set's
            self.form = f"{self.form}-q6ends"
        self.lib = native.load(isa)
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
        return Packed.of(weight, self.isa == "avx2")

    def embedding(self, ids, table, dtype):
        if not isinstance(table, Packed):
            return self._rows(ids, table)
        out = torch.empty((ids.shape[0], table.k), dtype=dtype)   # a tied LM head's rows, or a quantized table's
        self.lib.mcpd_embedding(self.codes[out.dtype], ctypes.byref(table.matrix()), table.k, ids.data_ptr(),
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
        self.lib.mcpd_linear(self.codes[x.dtype], x.data_ptr(), x.shape[0], weight.k, ctypes.byref(weight.matrix()),
                             native.address(bias), weight.n, y.data_ptr(), y_f32)
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


def _paged(kv_cache: torch.Tensor, group) -> tuple[int, ...]:
    """A layer's paged cache and a group's block tables as the attention kernels take them: base
    address, block stride, offset of values after keys, block size, tables, table stride."""
    table = group.block_table
    return (kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[2], table.data_ptr(),
            table.stride(0))

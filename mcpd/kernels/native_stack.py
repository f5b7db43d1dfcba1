"""A Llama model's whole decoder stack as one native call (mcpd_decoder_stack in kernels.c), and
a lone sequence's greedy decode steps, several in one call (mcpd_greedy_steps).

Calling the nine kernels of each layer one by one from Python costs about as much as running the
small ones (ctypes, a torch tensor for every result, attribute lookups): tens of microseconds a
layer, hundreds a step. NativeStack describes the layers once, as C records of their weights'
and caches' addresses, and each step hands over only the step's own arrays. The kernels and
their order are those of LlamaForCausalLM.forward, which the torch kernels still run.
"""
from __future__ import annotations

import array
import ctypes

import torch

from mcpd.kernels.native import Matrix, address
from mcpd.models.layers import AttentionMetadata

_P, _I = ctypes.c_void_p, ctypes.c_int64
REUSED_SCRATCH_ROWS = 64   # steps of up to this many rows share one scratch buffer (_scratch)


class Layer(ctypes.Structure):
    _fields_ = ([(name, Matrix) for name in ("qkv", "o", "gate_up", "down")]
                + [(name, _P) for name in ("input_norm", "qkv_bias", "o_bias", "post_norm", "gate_up_bias", "down_bias",
                                           "kv")])


class Shape(ctypes.Structure):
    _fields_ = [(name, _I) for name in ("hidden", "inter", "heads", "kv_heads", "head_dim", "block_stride",
                                        "v_offset", "block_size")] + [("eps", ctypes.c_float),
                                                                      ("scale", ctypes.c_float)]


class Greedy(ctypes.Structure):
    _fields_ = [("embedding", Matrix), ("rows", _I), ("plain", _I), ("head", Matrix), ("vocab", _I),
                ("final_norm", _P), ("rope", _P), ("table", _P), ("table_len", _I)]


class Group(ctypes.Structure):
    _fields_ = [(name, _I) for name in ("decoding", "start", "b", "table_stride")] + \
               [(name, _P) for name in ("table", "lens", "first_rows", "starts", "counts")]


class NativeStack:
    def __init__(self, kernels, weights, args) -> None:
        """weights: the model's ModelWeights packed for kernels (NativeKernels); args: LlamaArgs.
        The layers' KV caches must be bound (bind_kv_cache): their addresses are taken here."""
        self.lib, self.code = kernels.lib, kernels.codes[weights.final_norm.dtype]
        first_cache = weights.layers[0].attention.kv_cache
        self.cache_address = first_cache.data_ptr()
        self.layers = (Layer * len(weights.layers))(*(
            Layer(w.qkv.matrix(), w.o.matrix(), w.gate_up.matrix(), w.down.matrix(), w.input_norm.data_ptr(),
                  address(w.qkv_bias), address(w.o_bias), w.post_norm.data_ptr(), address(w.gate_up_bias),
                  address(w.down_bias), w.attention.kv_cache.data_ptr())
            for w in weights.layers))
        self.shape = Shape(args.hidden_size, args.intermediate_size, args.num_heads, args.num_kv_heads,
                           args.head_dim, first_cache.stride(0), first_cache.stride(1), first_cache.shape[2],
                           args.rms_norm_eps, weights.layers[0].attention.scale)
        self.final_norm = weights.final_norm
        # Scratch is linear in the step's rows (mcpd_stack_scratch_bytes): sized here, not by a
        # native call each step, and one buffer serves every step of up to REUSED_SCRATCH_ROWS.
        self.scratch_row_bytes = self.lib.mcpd_stack_scratch_bytes(self.code, ctypes.byref(self.shape), 1)
        self.reused_scratch: torch.Tensor | None = None
        self.greedy_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self, residual: torch.Tensor, rope: torch.Tensor, attn: AttentionMetadata,
            rows: torch.Tensor | None = None) -> torch.Tensor:
        """residual: the step's embeddings [T, hidden] (updated in place); returns the final norm
        of the rows given (ascending, each the last of its sequence in the step: a row that
        samples), or of every row (None). The last layer computes only those rows past storing
        every row's keys and values."""
        scratch = self._scratch(residual.shape[0])
        out = residual.new_empty((residual.shape[0] if rows is None else rows.shape[0], residual.shape[1]))
        groups = (Group * len(attn.groups))(*(
            Group(g.decoding, g.start, g.block_table.shape[0], g.block_table.stride(0), g.block_table.data_ptr(),
                  g.context_lens.data_ptr(), address(g.first_rows), address(g.starts), address(g.counts))
            for g in attn.groups))
        self.lib.mcpd_decoder_stack(self.code, ctypes.byref(self.shape), self.layers, len(self.layers),
                                    residual.shape[0], residual.data_ptr(), rope.data_ptr(),
                                    attn.positions.data_ptr(), attn.slot_blocks.data_ptr(),
                                    attn.slot_offsets.data_ptr(), groups, len(attn.groups),
                                    -1 if rows is None else rows.shape[0], address(rows), scratch.data_ptr(),
                                    self.final_norm.data_ptr(), out.data_ptr())
        return out

    def greedy_steps(self, embedding, head, rope: torch.Tensor, token: int, position: int, block_table: list[int],
                     steps: int, stops: tuple[int, ...]) -> list[int]:
        """Up to `steps` greedy decode steps of one sequence in one native call (mcpd_greedy_steps):
        token, its last sampled token, goes to `position`; block_table must give every position
        written a slot. Ends after a token of stops. The tokens chosen, each the argmax of the
        logits the step-by-step path computes: the same kernels in the same order."""
        if self.greedy_buffers is None:   # [residual, hidden] of the model dtype, then the logits
            self.greedy_buffers = (torch.empty(2, self.final_norm.shape[0], dtype=self.final_norm.dtype),
                                   torch.empty(head.n, dtype=torch.float32))
        rows, logits = self.greedy_buffers
        plain = isinstance(embedding, torch.Tensor)   # else packed: a tied head's panels, or a quantized table's
        table, stop_ids, tokens = array.array("q", block_table), array.array("q", stops), array.array("q", bytes(8 * steps))
        described = Greedy(Matrix(embedding.data_ptr()) if plain else embedding.matrix(),
                           embedding.shape[0] if plain else embedding.n, plain, head.matrix(), head.n,
                           self.final_norm.data_ptr(), rope.data_ptr(), table.buffer_info()[0], len(table))
        count = self.lib.mcpd_greedy_steps(self.code, ctypes.byref(self.shape), self.layers, len(self.layers),
                                           ctypes.byref(described), token, position, steps, stop_ids.buffer_info()[0],
                                           len(stop_ids), self._scratch(1).data_ptr(), rows[0].data_ptr(),
                                           rows[1].data_ptr(), logits.data_ptr(), tokens.buffer_info()[0])
        if count < 0:
            raise IndexError(f"token {token} or positions {position}..{position + steps - 1} outside the model or table")
        return tokens[:count].tolist()

    def _scratch(self, rows: int) -> torch.Tensor:
        """The stack's scratch for a step of `rows` rows, not a region of the device pool. Steps of
        up to REUSED_SCRATCH_ROWS (decodes) share one buffer (a few MB even for a 7B model): a
        fresh one a step would cost an allocation and cold pages after every weight stream.
        Larger steps (prefill chunks) take a fresh one, whose cost is small beside such a step,
        rather than keep a buffer at the largest step's size (hundreds of MB for a 7B). Activations
        need not outlive a worker; on a GPU a pool region would keep them inside the pool's share
        (pool_segment.py)."""
        if rows > REUSED_SCRATCH_ROWS:
            return torch.empty(rows * self.scratch_row_bytes, dtype=torch.uint8)
        if self.reused_scratch is None:
            self.reused_scratch = torch.empty(REUSED_SCRATCH_ROWS * self.scratch_row_bytes, dtype=torch.uint8)
        return self.reused_scratch

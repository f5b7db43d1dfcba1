"""A Llama model's whole decoder stack as one native call (mcpd_decoder_stack in kernels.c).

Calling the nine kernels of each layer one by one from Python cost about as much as running the
small ones (ctypes, a torch tensor for every result, attribute lookups): tens of microseconds a
layer, hundreds a step. NativeStack describes the layers once, as C records of their weights'
and caches' addresses, and each step hands over only the step's own arrays. The kernels and
their order are those of LlamaForCausalLM.forward, which the torch kernels still run.
"""
from __future__ import annotations

import ctypes

import torch

from mcpd.models.layers import AttentionMetadata

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up",
                                        "gate_up_bias", "down", "down_bias", "kv", "qkv_scale", "o_scale",
                                        "gate_up_scale", "down_scale")]


class Shape(ctypes.Structure):
    _fields_ = [(name, _I) for name in ("hidden", "inter", "heads", "kv_heads", "head_dim", "block_stride",
                                        "v_offset", "block_size")] + [("eps", ctypes.c_float),
                                                                      ("scale", ctypes.c_float)]


class Group(ctypes.Structure):
    _fields_ = [(name, _I) for name in ("decoding", "start", "b", "table_stride")] + \
               [(name, _P) for name in ("table", "lens", "first_rows", "starts", "counts")]


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeStack:
    def __init__(self, kernels, weights, args) -> None:
        """weights: the model's ModelWeights packed for kernels (NativeKernels); args: LlamaArgs.
        The layers' KV caches must be bound (bind_kv_cache): their addresses are taken here."""
        self.lib, self.code = kernels.lib, kernels.codes[weights.final_norm.dtype]
        first_cache = weights.layers[0].attention.kv_cache
        self.cache_address = first_cache.data_ptr()
        self.layers = (Layer * len(weights.layers))(*(
            Layer(w.input_norm.data_ptr(), w.qkv.panels.data_ptr(), _address(w.qkv_bias), w.o.panels.data_ptr(),
                  _address(w.o_bias), w.post_norm.data_ptr(), w.gate_up.panels.data_ptr(), _address(w.gate_up_bias),
                  w.down.panels.data_ptr(), _address(w.down_bias), w.attention.kv_cache.data_ptr(),
                  _address(w.qkv.scales), _address(w.o.scales), _address(w.gate_up.scales), _address(w.down.scales))
            for w in weights.layers))
        self.shape = Shape(args.hidden_size, args.intermediate_size, args.num_heads, args.num_kv_heads,
                           args.head_dim, first_cache.stride(0), first_cache.stride(1), first_cache.shape[2],
                           args.rms_norm_eps, weights.layers[0].attention.scale)
        self.final_norm = weights.final_norm

    def run(self, residual: torch.Tensor, rope: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """residual: the step's embeddings [T, hidden] (updated in place); returns the final norm."""
        rows = residual.shape[0]
        # A fresh scratch each step, not a region of the device pool: on the CPU its cost is the
        # allocator's and the first touch of its pages, measured at 10 us a step for a 32-sequence
        # decode of the embedded model (434 KB; the step takes milliseconds), 51 us for a 7B
        # model's (3.7 MB; the step hundreds of ms), 0.5 ms for a 2048-token prefill's 28 MB:
        # under 0.5% of every step. A region sized for the largest step would hold that much of
        # the pool share for good (236 MB for a 7B's 2048 tokens) to save it, and activations
        # need not outlive a worker. (On a GPU a pool region would keep them inside the pool's
        # share of device memory: pool_segment.py.)
        scratch = torch.empty(self.lib.mcpd_stack_scratch_bytes(self.code, ctypes.byref(self.shape), rows),
                              dtype=torch.uint8)
        out = torch.empty_like(residual)
        groups = (Group * len(attn.groups))(*(
            Group(g.decoding, g.start, g.block_table.shape[0], g.block_table.stride(0), g.block_table.data_ptr(),
                  g.context_lens.data_ptr(), _address(g.first_rows), _address(g.starts), _address(g.counts))
            for g in attn.groups))
        self.lib.mcpd_decoder_stack(self.code, ctypes.byref(self.shape), self.layers, len(self.layers), rows,
                                    residual.data_ptr(), rope.data_ptr(), attn.positions.data_ptr(),
                                    attn.slot_blocks.data_ptr(), attn.slot_offsets.data_ptr(), groups,
                                    len(attn.groups), scratch.data_ptr(), self.final_norm.data_ptr(),
                                    out.data_ptr())
        return out

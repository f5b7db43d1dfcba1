"""The Llama family: Llama 2/3, TinyLlama, Mistral, and Qwen2/2.5 (Llama with q/k/v bias).

q/k/v and gate/up projections are fused into one matmul each; map_weight() packs the separate
checkpoint tensors into them, so module names otherwise follow Hugging Face checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mcpd.models.kernels import TORCH, TorchKernels, choose
from mcpd.models.layers import AttentionMetadata, Llama3RopeScaling, PagedAttention, RMSNorm, RotaryEmbedding


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None = None
    qkv_bias: bool = False      # Qwen2, or Llama's attention_bias
    o_bias: bool = False        # Llama's attention_bias only
    mlp_bias: bool = False
    tie_embeddings: bool = False


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.attn = PagedAttention(scale=self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, attn: AttentionMetadata,
                kernels: TorchKernels) -> torch.Tensor:
        qkv = kernels.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q = kernels.rope_store(qkv, self.heads, self.kv_heads, self.head_dim, rope, attn.positions,
                               attn.slot_blocks, attn.slot_offsets, self.attn.kv_cache)
        return kernels.linear(self.attn.attend(q, attn, kernels), self.o_proj.weight, self.o_proj.bias)


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, kernels: TorchKernels) -> torch.Tensor:
        gate_up = kernels.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return kernels.linear(kernels.silu_mul(gate_up), self.down_proj.weight, self.down_proj.bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None, rope: torch.Tensor,
                attn: AttentionMetadata, kernels: TorchKernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, what this layer adds to it). The previous layer's addition is made
        here, fused with the norm that follows it (delta is None for the first layer)."""
        norm = self.input_layernorm
        residual, x = kernels.add_rms_norm(residual, delta, norm.weight, norm.eps)
        norm = self.post_attention_layernorm
        residual, x = kernels.add_rms_norm(residual, self.self_attn(x, rope, attn, kernels), norm.weight, norm.eps)
        return residual, self.mlp(x, kernels)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # checkpoint projection -> (fused parameter, index of its slice in the fused output rows)
    PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, args: LlamaArgs, device: torch.device) -> None:
        super().__init__()
        self.args = args
        self.num_layers, self.num_kv_heads, self.head_dim = args.num_layers, args.num_kv_heads, args.head_dim
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, device)
        self.model = LlamaModel(args)
        # Tied embeddings get no lm_head at all: a shared Parameter would not survive to_empty().
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.kernels: TorchKernels = TORCH   # use_kernels() picks, once the weights are in place

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        residual, delta = self.model.embed_tokens(input_ids), None
        rope = self.rope.table(attn.num_positions, residual.dtype)
        for layer in self.model.layers:
            residual, delta = layer(residual, delta, rope, attn, self.kernels)
        norm = self.model.norm
        return self.kernels.add_rms_norm(residual, delta, norm.weight, norm.eps)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return self.kernels.logits(hidden, head.weight)

    def use_kernels(self, requested: str) -> str:
        """Pick the kernels for engine.kernels = requested (see kernels.choose); returns which, and why."""
        args = self.args
        sizes = [args.hidden_size, args.intermediate_size, args.num_heads * args.head_dim,
                 args.num_kv_heads * args.head_dim]
        self.kernels, reason = choose(requested, self.model.embed_tokens.weight.dtype,
                                      self.model.embed_tokens.weight.device, sizes, args.head_dim,
                                      args.num_heads // args.num_kv_heads)
        return reason

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, int, torch.Tensor] | None:
        """Checkpoint tensor -> (parameter name, first row it fills, tensor); None to skip it."""
        if name.endswith("rotary_emb.inv_freq"):  # recomputed, saved by old checkpoints
            return None
        if name == "lm_head.weight" and self.args.tie_embeddings:
            return None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.PACKED:
            fused, index = self.PACKED[parts[-2]]
            parts[-2] = fused
            return ".".join(parts), self._packed_row(fused, index), tensor
        return name, 0, tensor

    def _packed_row(self, fused: str, index: int) -> int:
        args = self.args
        if fused == "gate_up_proj":
            return index * args.intermediate_size
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        return (0, q_size, q_size + kv_size)[index]

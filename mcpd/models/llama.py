"""The Llama family: Llama 2/3, TinyLlama, Mistral, and Qwen2/2.5 (Llama with q/k/v bias).

q/k/v and gate/up projections are fused into one matmul each; map_weight() packs the separate
checkpoint tensors into them, so module names otherwise follow Hugging Face checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mcpd.models.layers import (AttentionMetadata, Llama3RopeScaling, PagedAttention, RMSNorm,
                                RotaryEmbedding, apply_rotary)


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rotary(q.view(-1, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.kv_heads, self.head_dim), cos, sin)
        return self.o_proj(self.attn(q, k, v.view(-1, self.kv_heads, self.head_dim), attn))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = LlamaMLP(args)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)  # once per step, shared by every layer
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head.weight).float()

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

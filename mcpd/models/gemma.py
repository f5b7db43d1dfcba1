"""Gemma 2 and Gemma 3 (text): see architecture.GemmaArgs. On torch's ops only (the native and
CUDA kernels have neither soft-capping nor these norms); module names follow the checkpoints, whose
q/k/v and gate/up projections stay apart."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcpd.kernels.choice import torch_for
from mcpd.kernels.forms import KernelForms
from mcpd.kernels.torch_kernels import TORCH
from mcpd.models.architecture import GemmaArgs
from mcpd.models.layers import AttentionMetadata, Embedding, PagedAttention, RMSNorm, RotaryEmbedding


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + weight), in float32 and rounded once at the end, as transformers'
    Gemma rounds it (Llama's rounds before scaling)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


class GemmaAttention(nn.Module):
    def __init__(self, args: GemmaArgs, layer_index: int) -> None:
        super().__init__()
        self.args = args
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.local = layer_index in args.sliding_layers
        self.attn = PagedAttention(args.query_pre_attn_scalar ** -0.5, args.sliding_window if self.local else None,
                                   args.attn_softcap)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionMetadata) -> torch.Tensor:
        a = self.args
        q, k = self.q_proj(x), self.k_proj(x)
        if a.qk_norm:
            q = gemma_norm(q.view(-1, a.num_heads, a.head_dim), self.q_norm.weight, a.rms_norm_eps).flatten(1)
            k = gemma_norm(k.view(-1, a.num_kv_heads, a.head_dim), self.k_norm.weight, a.rms_norm_eps).flatten(1)
        table, rows = rope
        q = TORCH.rope_store(torch.cat((q, k, self.v_proj(x)), dim=-1), a.num_heads, a.num_kv_heads, a.head_dim,
                             table, rows, attn.slot_blocks, attn.slot_offsets, self.attn.kv_cache)
        return self.o_proj(self.attn.attend(q, attn, TORCH))


class GemmaMLP(nn.Module):
    def __init__(self, args: GemmaArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, args: GemmaArgs, layer_index: int) -> None:
        super().__init__()
        self.eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = GemmaAttention(args, layer_index)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GemmaMLP(args)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn(gemma_norm(x, self.input_layernorm.weight, self.eps), rope, attn)
        x = x + gemma_norm(h, self.post_attention_layernorm.weight, self.eps)
        h = self.mlp(gemma_norm(x, self.pre_feedforward_layernorm.weight, self.eps))
        return x + gemma_norm(h, self.post_feedforward_layernorm.weight, self.eps)


class GemmaModel(nn.Module):
    def __init__(self, args: GemmaArgs) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class GemmaForCausalLM(KernelForms, nn.Module):
    def __init__(self, args: GemmaArgs, device: torch.device) -> None:
        super().__init__()
        self.args = args
        self.num_layers, self.num_kv_heads, self.head_dim = args.num_layers, args.num_kv_heads, args.head_dim
        self.global_rope = RotaryEmbedding(args.head_dim, args.global_rope_theta, args.global_rope_scaling, device)
        self.local_rope = RotaryEmbedding(args.head_dim, args.local_rope_theta, args.local_rope_scaling, device)
        self.model = GemmaModel(args)
        # Tied: no lm_head at all (a shared Parameter would not survive to_empty()).
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.kernels = TORCH

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of `rows` (None: of every row)."""
        embedding = self.model.embed_tokens.weight
        # sqrt(hidden) as transformers holds it: a float32 tensor, rounded to the model dtype
        x = F.embedding(input_ids, embedding) * torch.tensor(self.args.hidden_size ** 0.5).to(embedding.dtype)
        ropes = {False: self.global_rope.for_step(attn, x.dtype), True: self.local_rope.for_step(attn, x.dtype)}
        for layer in self.model.layers:
            x = layer(x, ropes[layer.self_attn.local], attn)
        x = x if rows is None else x[rows]
        return gemma_norm(x, self.model.norm.weight, self.args.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = F.linear(hidden, head.weight)
        cap = self.args.final_softcap
        return (logits if cap is None else torch.tanh(logits / cap) * cap).float()

    def choose_kernels(self, requested: str) -> str:
        self.kernels, reason = torch_for(requested, "Gemma layers")
        return reason

    def use_kernels(self, requested: str) -> str:
        return self.choose_kernels(requested)

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, int, torch.Tensor] | None:
        """Checkpoint tensor -> (parameter name, first row it fills, tensor); None to skip it."""
        if (name == "lm_head.weight" and self.lm_head is None) or name.endswith("rotary_emb.inv_freq"):
            return None
        return name, 0, tensor

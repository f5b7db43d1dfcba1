"""GPT-2: learned positions, LayerNorm, fused c_attn, GELU MLP, lm_head tied to the embeddings
unless config.json says tie_word_embeddings = false (then the checkpoint holds its own).

Checkpoints store the projections as Conv1D weights, [in, out]; map_weight() transposes them into
nn.Linear's [out, in] once at load time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mcpd.models.architecture import GPT2Args
from mcpd.kernels.forms import KernelForms
from mcpd.kernels.torch_kernels import TORCH
from mcpd.models.layers import AttentionMetadata, Embedding, PagedAttention
from mcpd.kernels.native import NativeUnavailable


class GPT2Attention(nn.Module):
    def __init__(self, args: GPT2Args, layer_index: int) -> None:
        super().__init__()
        self.heads, self.head_dim = args.num_heads, args.hidden_size // args.num_heads
        scale = self.head_dim ** -0.5 if args.scale_attn_weights else 1.0
        if args.scale_attn_by_inverse_layer_idx:
            scale /= layer_index + 1
        self.c_attn = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.c_proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.attn = PagedAttention(scale)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        q, k, v = (t.view(-1, self.heads, self.head_dim) for t in self.c_attn(x).chunk(3, dim=-1))
        return self.c_proj(self.attn(q, k, v, attn))


class GPT2MLP(nn.Module):
    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.c_fc = nn.Linear(args.hidden_size, args.inner_size)
        self.c_proj = nn.Linear(args.inner_size, args.hidden_size)
        self.approximate = args.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    def __init__(self, args: GPT2Args, layer_index: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.attn = GPT2Attention(args, layer_index)
        self.ln_2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = GPT2MLP(args)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(KernelForms, nn.Module):
    CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    def __init__(self, args: GPT2Args) -> None:
        super().__init__()
        self.num_layers, self.num_kv_heads = args.num_layers, args.num_heads
        self.head_dim = args.hidden_size // args.num_heads
        self.wte = Embedding(args.vocab_size, args.hidden_size)
        self.wpe = Embedding(args.max_positions, args.hidden_size)
        self.h = nn.ModuleList(GPT2Block(args, i) for i in range(args.num_layers))
        self.ln_f = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        # Tied: no lm_head at all (a shared Parameter would not survive to_empty()).
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.kernels = TORCH

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of `rows` (None: of every row)."""
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, attn)
        x = x if rows is None else x[rows]
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.wte if self.lm_head is None else self.lm_head
        return F.linear(hidden, head.weight).float()

    def choose_kernels(self, requested: str) -> str:
        """GPT-2 runs on torch's ops only, on its parameters as they are."""
        if requested.startswith("native"):
            raise NativeUnavailable(f"GPT-2 has no native kernels (engine.kernels = {requested})")
        return "torch (GPT-2)"

    def use_kernels(self, requested: str) -> str:
        return self.choose_kernels(requested)

    def map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, int, torch.Tensor] | None:
        """Checkpoint tensor -> (parameter name, first row it fills, tensor); None to skip it."""
        name = name.removeprefix("transformer.")
        # A tied lm_head duplicates wte; attn.bias / attn.masked_bias are causal-mask buffers.
        if (name == "lm_head.weight" and self.lm_head is None) or name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        if name.endswith(self.CONV1D):
            tensor = tensor.t()
        return name, 0, tensor

"""The Llama family: Llama 2/3, TinyLlama, Mistral, Qwen2/2.5 (Llama with q/k/v bias), Qwen3 (with
q/k norms), Phi-3 (whose checkpoints hold q/k/v and gate/up fused already) and Mixtral (a
mixture of experts for each MLP: experts.py).

q/k/v and gate/up projections are fused into one matmul each; map_weight() packs the separate
checkpoint tensors into them, so module names otherwise follow Hugging Face checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mcpd.gguf_file import part_name
from mcpd.models.architecture import LlamaArgs
from mcpd.models.experts import MixtureOfExperts
from mcpd.quant.int8 import SCALE_SUFFIX, Int8Weight
from mcpd.kernels.forms import Form, KernelForms
from mcpd.kernels.choice import choose, torch_for
from mcpd.kernels.native_kernels import Packed
from mcpd.kernels.row_parts import RowParts
from mcpd.kernels.torch_kernels import TORCH, TorchKernels
from mcpd.models.layers import AttentionMetadata, Embedding, PagedAttention, RMSNorm, RotaryEmbedding
from mcpd.models.split_linear import SplitLinear
from mcpd.kernels.native_stack import NativeStack


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int) -> None:
        super().__init__()
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, q_size + 2 * kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=args.o_bias)
        window = args.sliding_window if layer_index in args.sliding_layers else None
        self.attn = PagedAttention(args.head_dim ** -0.5, window)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = LlamaAttention(args, layer_index)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.num_experts:
            self.block_sparse_moe = MixtureOfExperts(args.hidden_size, args.intermediate_size, args.num_experts,
                                                     args.experts_per_token)
        else:
            self.mlp = LlamaMLP(args)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's tensors as plain attributes, weight matrices in the form the kernels
    multiply (kernels.prepare: packed for the native ones): reaching them through nn.Module's
    attribute lookup costs microseconds each, hundreds of times per step."""
    input_norm: torch.Tensor
    qkv: torch.Tensor | Int8Weight | Packed | RowParts
    qkv_bias: torch.Tensor | None
    attention: PagedAttention
    o: torch.Tensor | Int8Weight | Packed
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | Int8Weight | Packed | RowParts
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | Int8Weight | Packed
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None   # Qwen3's norms of each query and key head
    k_norm: torch.Tensor | None
    experts: MixtureOfExperts | None   # Mixtral's, in place of gate_up and down

    @classmethod
    def of(cls, layer: LlamaDecoderLayer, prefix: str, forms: dict[str, Form]) -> LayerWeights:
        """forms: every parameter's form by name (KernelForms); prefix: this layer's names'."""
        def form(name: str) -> Form | None:   # None: a bias the model has not
            return forms.get(prefix + name)

        def fused(module: nn.Module, name: str) -> Form | None:   # a split one's parts joined
            return module.form(forms, prefix + name) if isinstance(module, SplitLinear) else form(name)
        mlp = getattr(layer, "mlp", None)
        return cls(form("input_layernorm.weight"), fused(layer.self_attn.qkv_proj, "self_attn.qkv_proj.weight"),
                   form("self_attn.qkv_proj.bias"),
                   layer.self_attn.attn, form("self_attn.o_proj.weight"), form("self_attn.o_proj.bias"),
                   form("post_attention_layernorm.weight"), fused(mlp and mlp.gate_up_proj, "mlp.gate_up_proj.weight"),
                   form("mlp.gate_up_proj.bias"), form("mlp.down_proj.weight"), form("mlp.down_proj.bias"),
                   form("self_attn.q_norm.weight"), form("self_attn.k_norm.weight"),
                   getattr(layer, "block_sparse_moe", None))


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """The forward pass's tensors, out of nn.Module's way (see LayerWeights)."""
    layers: list[LayerWeights]
    embedding: torch.Tensor | Packed   # the (prepared) head itself when the two are tied
    final_norm: torch.Tensor
    head: torch.Tensor | Int8Weight | Packed

    @classmethod
    def of(cls, model: LlamaForCausalLM, forms: dict[str, Form]) -> ModelWeights:
        embedding = forms["model.embed_tokens.weight"]   # prepared, as the head, when the two are tied
        return cls([LayerWeights.of(layer, f"model.layers.{i}.", forms) for i, layer in enumerate(model.model.layers)],
                   embedding, forms["model.norm.weight"], forms.get("lm_head.weight", embedding))


class LlamaForCausalLM(KernelForms, nn.Module):
    # checkpoint projection -> (fused parameter, index of its slice in the fused output rows)
    PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
              "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1)}   # a Mixtral expert's gate and up
    RENAMED = {"w2": "down_proj"}   # a Mixtral expert's down

    def __init__(self, args: LlamaArgs, device: torch.device) -> None:
        super().__init__()
        self.args = args
        self.num_layers, self.num_kv_heads, self.head_dim = args.num_layers, args.num_kv_heads, args.head_dim
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling, device)
        self.model = LlamaModel(args)
        # Tied embeddings get no lm_head at all: a shared Parameter would not survive to_empty().
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.kernels: TorchKernels = TORCH   # use_kernels() picks, once the weights are in place
        self._weights: ModelWeights | None = None
        self._stack: NativeStack | None = None

    @property
    def weights(self) -> ModelWeights:
        if self._weights is None:
            self._weights = ModelWeights.of(self, dict(self.kernel_forms()))
        return self._weights

    def _apply(self, fn, recurse=True):
        """to(), to_empty() and the like may put new Parameters in place: forget the old ones
        (before the kernels are chosen: the loader moves and casts the skeleton, nothing does after)."""
        if self.kernels.form != TORCH.form:
            raise RuntimeError("a model whose weights are prepared for the native kernels cannot be moved or cast")
        self._weights = None
        return super()._apply(fn, recurse)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Each layer: x = norm(residual); residual += attention(x); x = norm(residual);
        residual += mlp(x), with each residual addition fused into the norm that follows it. The
        native kernels run this loop in C (NativeStack), the same kernels in the same order, and
        the last layer past its keys and values only for `rows`. rows: the rows whose final
        hidden state is wanted, ascending, each the last of its sequence (None: every row)."""
        k, eps, weights = self.kernels, self.args.rms_norm_eps, self.weights
        residual, delta = k.embedding(input_ids, weights.embedding, weights.final_norm.dtype), None
        rope, rope_rows = self.rope.for_step(attn, residual.dtype)
        if k.stacks_layers:
            return self._native_stack().run(residual, rope, attn, rows)
        for w in weights.layers:
            residual, q = self._attention_inputs(residual, delta, w, rope, rope_rows, attn)
            residual, x = k.add_rms_norm(residual, k.linear(w.attention.attend(q, attn, k), w.o, w.o_bias),
                                         w.post_norm, eps)
            delta = (k.linear(k.silu_mul(k.linear(x, w.gate_up, w.gate_up_bias)), w.down, w.down_bias)
                     if w.experts is None else w.experts(x, k))
        if rows is not None:
            residual, delta = residual[rows], delta[rows]
        return k.add_rms_norm(residual, delta, weights.final_norm, eps)[1]

    def _attention_inputs(self, residual: torch.Tensor, delta: torch.Tensor | None, w: LayerWeights,
                          rope: torch.Tensor, rope_rows: torch.Tensor,
                          attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, the queries), keys and values stored: the kernels' attention_inputs,
        or step by step with Qwen3's q/k norms between the product and rope."""
        k, a, eps = self.kernels, self.args, self.args.rms_norm_eps
        if w.q_norm is None:
            return k.attention_inputs(residual, delta, w.input_norm, eps, w.qkv, w.qkv_bias, a.num_heads,
                                      a.num_kv_heads, a.head_dim, rope, rope_rows, attn.slot_blocks,
                                      attn.slot_offsets, w.attention.kv_cache)
        residual, x = k.add_rms_norm(residual, delta, w.input_norm, eps)
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q, key, v = k.linear(x, w.qkv, w.qkv_bias).split((q_size, kv_size, kv_size), dim=-1)
        q = k.add_rms_norm(q.reshape(-1, a.num_heads, a.head_dim), None, w.q_norm, eps)[1]
        key = k.add_rms_norm(key.reshape(-1, a.num_kv_heads, a.head_dim), None, w.k_norm, eps)[1]
        qkv = torch.cat((q.flatten(1), key.flatten(1), v), dim=-1)
        return residual, k.rope_store(qkv, a.num_heads, a.num_kv_heads, a.head_dim, rope, rope_rows,
                                      attn.slot_blocks, attn.slot_offsets, w.attention.kv_cache)

    def _native_stack(self) -> NativeStack:
        """The layers as one native call, described once the KV cache is bound (anew if it was
        bound again: a new cache)."""
        cache = self.weights.layers[0].attention.kv_cache
        if self._stack is None or self._stack.cache_address != cache.data_ptr():
            self._stack = NativeStack(self.kernels, self.weights, self.args)
        return self._stack

    @property
    def runs_greedy_steps(self) -> bool:
        """Whether greedy_steps runs here: the native kernels' stack does it (reading embedding
        rows as a plain table's or a tied head's)."""
        embedding = self.weights.embedding
        return self.kernels.stacks_layers and (not isinstance(embedding, torch.Tensor) or embedding.is_contiguous())

    def greedy_steps(self, token: int, position: int, block_table: list[int], steps: int,
                     stops: tuple[int, ...]) -> list[int]:
        """Up to `steps` greedy decode steps of one sequence without Python between them
        (NativeStack.greedy_steps): the tokens forward, compute_logits and argmax would choose."""
        weights = self.weights
        rope = self.rope.table(position + steps, weights.final_norm.dtype)
        return self._native_stack().greedy_steps(weights.embedding, weights.head, rope, token, position, block_table,
                                                 steps, stops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernels.logits(hidden, self.weights.head)

    def choose_kernels(self, requested: str) -> str:
        """Pick the kernels for engine.kernels = requested (see kernels.choose); returns which, and
        why. On the skeleton, before any weight is read: the form the weights are kept in
        (kernel_forms) follows from the choice."""
        args = self.args
        sizes = [args.hidden_size, args.intermediate_size, args.num_heads * args.head_dim,
                 args.num_kv_heads * args.head_dim]
        norm = self.model.norm.weight   # the model dtype's (a GGUF's embedding may be quantized)
        torch_only = self._torch_only_feature()
        if torch_only:
            self.kernels, reason = torch_for(requested, torch_only)
        else:
            self.kernels, reason = choose(requested, norm.dtype, norm.device, sizes, args.head_dim,
                                          args.num_heads // args.num_kv_heads)
        self._weights = None
        qkv = next(self.model.layers[0].self_attn.qkv_proj.parameters())   # a split one's first part's
        if self.kernels is TORCH and qkv.dtype == torch.int8 and qkv.device.type == "cpu":
            # int8.linear converts every weight at every product: correct, and on a CPU several
            # times slower than the float model; the speed of int8 is the native kernels' (and
            # on CUDA, int8_cuda's).
            reason += "; int8 weights on the torch kernels run slower than float ones"
        return reason

    def _torch_only_feature(self) -> str | None:
        """What of this model only the torch kernels run, if anything."""
        if self.args.sliding_window is not None:
            return "sliding-window attention"
        if self.rope.by_length:
            return "rope whose angles follow the sequence's length"
        if self.args.num_experts:
            return "mixture-of-experts layers"
        return "q/k norms" if self.args.qk_norm else None

    def prepared(self, name: str, param: torch.Tensor) -> bool:
        """The weight matrices the kernels multiply; the embedding table too when it is the head
        or quantized (the kernels read its rows). Not an int8 matrix's scales (2-D too): they
        are prepared with it."""
        return (param.dim() == 2 and not name.endswith(SCALE_SUFFIX)
                and (name != "model.embed_tokens.weight" or self.lm_head is None
                     or param.dtype in (torch.int8, torch.uint8)))

    def use_forms(self, forms: dict[str, Form]) -> None:
        super().use_forms(forms)
        self._weights = ModelWeights.of(self, forms)

    def use_kernels(self, requested: str) -> str:
        """choose_kernels, then run on the loaded weights prepared for them (packed copies for the
        native kernels: the modules' own matrices are then emptied, so the model is not held
        twice in memory)."""
        reason = self.choose_kernels(requested)
        self.use_forms(dict(self.kernel_forms()))
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
            return (*self._in_part(".".join(parts), self._packed_row(fused, index)), tensor)
        if len(parts) >= 2 and parts[-2] in self.RENAMED:
            parts[-2] = self.RENAMED[parts[-2]]
            return ".".join(parts), 0, tensor
        return name, 0, tensor

    def _in_part(self, target: str, row: int) -> tuple[str, int]:
        """(parameter, row) of a fused matrix's row `row` (target: the fused parameter): in its
        part where the matrix is split (split_linear.py), the bias being the whole's."""
        module_name, _, parameter = target.rpartition(".")
        module = self.get_submodule(module_name)
        if not isinstance(module, SplitLinear) or parameter == "bias":
            return target, row
        index, start = module.part_at(row)
        return part_name(target, index), row - start

    def _packed_row(self, fused: str, index: int) -> int:
        args = self.args
        if fused == "gate_up_proj":
            return index * args.intermediate_size
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        return (0, q_size, q_size + kv_size)[index]

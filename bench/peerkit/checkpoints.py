"""The peers benchmark's checkpoint: a random Llama-style model as a Hugging Face directory.

    .venv/bin/python bench/peerkit/checkpoints.py [--cache-dir DIR] [--dtype float32|bfloat16] [--small]

The shape: 8 layers, hidden 512, 8 query / 2 KV heads (head_dim 64), intermediate
1408, vocab 32000, untied embeddings: 55.3M parameters, seeded random weights. Every server in the
comparison loads the same directory (llama.cpp a GGUF converted from it), so they run the same
model on the same tokens.

The vocabulary is Llama-2's SentencePiece vocabulary. No model can be downloaded here, but
llama.cpp ships it as a GGUF vocab file in the llama-cpp-python sdist
(vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf, fetched by `peers.py --setup`); its pieces,
scores and types are read with the `gguf` package and turned into the tokenizer.json that
Llama-2's Hugging Face repository has: a BPE with byte fallback whose merges rank by the merged
piece's score, which is how SentencePiece's BPE picks its next merge. mcpd (tokenizers) and vLLM
(transformers) both load that file.

Without the vocab file (CI, or no `gguf` package) the builder falls back to a byte-level
vocabulary of the same size and layout: ids 0-2 are <unk>, <s>, </s>; 3-258 the byte tokens
<0x00>..<0xFF>; 259 the space piece "▁"; the rest are filler pieces `<extra_N>` that no text
produces. A text then encodes to BOS, "▁" and one token per UTF-8 byte (a space is "▁") and
decodes back exactly. The directory name says which vocabulary it holds.

Built directories are cached under the cache dir (default ~/.cache/mcpd-bench), never in the repo.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, processors

DEFAULT_CACHE = Path(os.environ.get("MCPD_BENCH_CACHE", Path.home() / ".cache" / "mcpd-bench"))
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPACE = "\u2581"   # SentencePiece's visible space
# SentencePiece piece types, as llama.cpp's GGUF stores them.
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
# Llama-2's chat format. Each user turn opens with BOS, so a context that renders one message per
# turn and a stateless server that renders the whole history both see the same token stream.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] }} "
                 "{% else %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}")


@dataclass(frozen=True)
class ModelShape:
    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1408
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matrices(self) -> dict[str, tuple[int, int]]:
        """Every weight matrix, by Hugging Face Llama name: (rows, columns)."""
        kv = self.kv_heads * self.head_dim
        layer = {"self_attn.q_proj": (self.hidden, self.hidden), "self_attn.k_proj": (kv, self.hidden),
                 "self_attn.v_proj": (kv, self.hidden), "self_attn.o_proj": (self.hidden, self.hidden),
                 "mlp.gate_proj": (self.intermediate, self.hidden), "mlp.up_proj": (self.intermediate, self.hidden),
                 "mlp.down_proj": (self.hidden, self.intermediate)}
        shapes = {"model.embed_tokens": (self.vocab, self.hidden), "lm_head": (self.vocab, self.hidden)}
        for i in range(self.layers):
            shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
        return shapes

    def norms(self) -> list[str]:
        return ([f"model.layers.{i}.{n}" for i in range(self.layers)
                 for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm"])

    @property
    def parameters(self) -> int:
        return sum(r * c for r, c in self.matrices().values()) + self.hidden * len(self.norms())

    @property
    def matmul_parameters(self) -> int:
        """Weights every token multiplies by: all but the embedding table (a one-row lookup).
        A decode step at batch 1 reads these once; a token costs 2 FLOPs per each."""
        return sum(r * c for name, (r, c) in self.matrices().items() if name != "model.embed_tokens")


ISSUE_SHAPE = ModelShape()
SMALL_SHAPE = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)   # tests
ONE_B_SHAPE = ModelShape(layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632)   # TinyLlama's


@dataclass(frozen=True)
class Vocab:
    name: str                 # "llama2" or "bytes": part of the checkpoint's directory name
    tokens: list[str]
    scores: list[float]
    types: list[int]


def llama2_vocab(vocab_file: Path) -> Vocab:
    """Llama-2's pieces, scores and types from llama.cpp's GGUF vocab file (needs `gguf`)."""
    from gguf import GGUFReader
    fields = GGUFReader(str(vocab_file)).fields
    return Vocab("llama2", [str(t) for t in fields["tokenizer.ggml.tokens"].contents()],
                 [float(s) for s in fields["tokenizer.ggml.scores"].contents()],
                 [int(t) for t in fields["tokenizer.ggml.token_type"].contents()])


def byte_vocab(size: int = 32000) -> Vocab:
    """The documented fallback: specials, 256 byte tokens, then filler no text produces."""
    tokens = [UNK, BOS, EOS] + [f"<0x{b:02X}>" for b in range(256)] + [SPACE]
    tokens += [f"<extra_{i}>" for i in range(size - len(tokens))]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (size - 259)
    return Vocab("bytes", tokens, [0.0] * size, types)


def find_vocab_file(cache_dir: Path) -> Path | None:
    """The Llama-2 GGUF vocab file inside the llama-cpp-python sdist that `--setup` unpacked."""
    found = sorted(cache_dir.glob("src/llama_cpp_python-*/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf"))
    return found[-1] if found else None


def load_vocab(cache_dir: Path) -> tuple[Vocab, str]:
    """Llama-2's vocabulary when it can be had, else the byte vocab; and a line saying which."""
    vocab_file = find_vocab_file(cache_dir)
    if vocab_file is None:
        return byte_vocab(), "byte-level fallback vocab (no llama-cpp-python sdist: run peers.py --setup)"
    try:
        return llama2_vocab(vocab_file), f"Llama-2 SentencePiece vocab from {vocab_file}"
    except ImportError:
        return byte_vocab(), "byte-level fallback vocab (the `gguf` package is missing: pip install -e .)"


def spm_merges(vocab: Vocab) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece BPE over these pieces.

    SentencePiece merges, at each step, the adjacent pair whose concatenation is the
    highest-scoring piece. So every way to split a normal piece into two normal pieces is a merge,
    ranked by the whole piece's score (ties: by the piece's id, then the parts' ids)."""
    ids = {t: i for i, t in enumerate(vocab.tokens) if vocab.types[i] == NORMAL}
    ranked = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[piece_id], piece_id, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def tokenizer_for(vocab: Vocab) -> Tokenizer:
    """Llama-2's tokenizer.json layout: "▁" before the text and for every space, BPE with byte
    fallback, BOS prepended; decoding undoes it and drops the leading space."""
    bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab.tokens)}, merges=spm_merges(vocab),
                     unk_token=UNK, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.add_special_tokens([UNK, BOS, EOS])
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab.tokens.index(BOS))])
    return tokenizer


def write_tokenizer(directory: Path, vocab: Vocab) -> Tokenizer:
    tokenizer = tokenizer_for(vocab)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
              "add_bos_token": True, "add_eos_token": False, "legacy": True, "model_max_length": 4096,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS,
                                                                   "unk_token": UNK}))
    return tokenizer


def random_weights(shape: ModelShape, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Normal(0, 0.02) matrices as transformers initialises Llama, norms at 1; drawn in float32
    so that the bfloat16 copy is the float32 model rounded, not another model."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {f"{name}.weight": torch.randn(rows, cols, generator=generator).mul_(0.02).to(dtype)
               for name, (rows, cols) in shape.matrices().items()}
    tensors.update({f"{name}.weight": torch.ones(shape.hidden, dtype=dtype) for name in shape.norms()})
    return tensors


def hf_config(shape: ModelShape, dtype: torch.dtype) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": shape.vocab, "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": str(dtype).removeprefix("torch.")}


def write_checkpoint(directory: Path, shape: ModelShape, vocab: Vocab, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write the model into directory (made afresh, then moved into place: never half-written)."""
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(json.dumps(hf_config(shape, dtype), indent=1))
    (partial / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file(random_weights(shape, dtype, seed), str(partial / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(partial, vocab)
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    return directory


def checkpoint(cache_dir: Path = DEFAULT_CACHE, dtype: torch.dtype = torch.float32,
               shape: ModelShape = ISSUE_SHAPE, seed: int = 0) -> tuple[Path, str]:
    """The cached checkpoint for dtype, built on first use; and the line naming its vocabulary."""
    vocab, source = load_vocab(cache_dir)
    name = f"llama-{shape.parameters / 1e6:.1f}m-{vocab.name}-{str(dtype).removeprefix('torch.')}-s{seed}"
    directory = cache_dir / "checkpoints" / name
    if not (directory / "model.safetensors").exists():
        write_checkpoint(directory, shape, vocab, dtype, seed)
    return directory, source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--small", action="store_true", help="the tests' tiny shape")
    args = parser.parse_args()
    shape = SMALL_SHAPE if args.small else ISSUE_SHAPE
    directory, source = checkpoint(args.cache_dir, getattr(torch, args.dtype), shape)
    print(f"{directory}\n  {shape.parameters / 1e6:.1f}M parameters, {source}")


if __name__ == "__main__":
    main()

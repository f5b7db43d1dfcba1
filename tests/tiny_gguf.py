"""Tiny GGUF files for tests, written with the gguf package's writer and quantizers from the tiny
random checkpoints of tiny_checkpoints.py, the way llama.cpp's converter writes them: llama.cpp's
key and tensor names, a Llama's Q and K rows permuted into llama.cpp's rotary layout, the
tokenizer as metadata (gpt2 byte-level BPE, or llama SentencePiece with scores).
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from k_quants import QUANTIZERS
from tiny_checkpoints import CHAT_TEMPLATE, hf_config, make_checkpoint, tokenizer_json

ARCH = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama", "llama_wide": "llama"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


# Files whose matrices mix types, as llama.cpp's mixes do: type -> each matrix's type by its GGUF
# name. A Q4_K_M keeps attn_v and ffn_down of some layers and the head in Q6_K (here layer 0's);
# where a matrix's inputs are not whole super-blocks llama.cpp falls back to Q5_0 (and Q8_0).
MIXES = {
    "Q4_K_M": lambda name: "Q6_K" if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight")
    else "Q4_K",
    "Q4_K_M_Q5_0": lambda name: "Q5_0" if ".ffn_down." in name or name == "blk.1.ffn_up.weight"
    else "Q6_K" if name in ("output.weight", "blk.0.attn_v.weight") else "Q4_K",
    "Q4_0_Q8_0": lambda name: "Q8_0" if ".attn_v." in name else "Q4_0",
}


def gguf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of a Llama's Q or K rows."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(directory: Path, kind: str, qtype: str = "F32", pre: str = "default", seed: int = 0,
               sentencepiece: bool = False, rope_freqs: np.ndarray | None = None, arch: str | None = None) -> Path:
    """A GGUF of a random `kind` model (llama, qwen2, mistral; llama_wide for Q4_K and Q6_K), its matrices in type `qtype`
    or as the mix MIXES names (norms and biases stay F32, as llama.cpp keeps them). Returns the file's path; the
    checkpoint it was made from is in directory / "hf". rope_freqs: Llama 3.1's divisors, as
    llama.cpp's converter stores them; arch: another general.architecture to claim."""
    checkpoint = make_checkpoint(directory / "hf", kind, seed=seed)
    config = hf_config(kind)
    arch = arch or ARCH[kind]
    path = directory / f"{kind}-{qtype}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    add_hyperparameters(writer, config)
    (write_sentencepiece if sentencepiece else write_byte_level)(writer, pre)
    writer.add_chat_template(CHAT_TEMPLATE)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    add_tensors(writer, load_file(str(checkpoint / "model.safetensors")), arch, config,
                lambda name, columns: MIXES[qtype](name) if qtype in MIXES else qtype)
    finish(writer)
    return path


def add_hyperparameters(writer: gguf.GGUFWriter, config) -> None:
    """A Hugging Face Llama-family config's shape as llama.cpp's keys."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or 10000.0))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)


def add_tensors(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray], arch: str, config, type_of) -> None:
    """A checkpoint's tensors under llama.cpp's names, a Llama's Q and K rows permuted; each matrix
    in type_of(its GGUF name, its columns), norms and biases F32 (as llama.cpp keeps them)."""
    for name, weights in tensors.items():
        if arch == "llama" and ".q_proj.weight" in name:
            weights = permute(weights, config.num_attention_heads)
        elif arch == "llama" and ".k_proj.weight" in name:
            weights = permute(weights, config.num_key_value_heads)
        add_tensor(writer, gguf_name(name), weights,
                   type_of(gguf_name(name), weights.shape[-1]) if weights.ndim == 2 else "F32")


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tensor(writer: gguf.GGUFWriter, name: str, weights: np.ndarray, qtype: str) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, weights.astype(np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, weights.astype(np.float16))
    elif qtype in QUANTIZERS:   # what the gguf package cannot quantize
        writer.add_tensor(name, QUANTIZERS[qtype](weights), raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(weights.astype(np.float32), kind), raw_dtype=kind)


def write_byte_level(writer: gguf.GGUFWriter, pre: str) -> None:
    """tiny_checkpoints' byte-level BPE: <s> and </s> are control tokens, BOS not added (gpt2)."""
    model = json.loads(tokenizer_json().to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("</s>"))


def write_sentencepiece(writer: gguf.GGUFWriter, pre: str) -> None:
    """A SentencePiece vocabulary as llama.cpp stores one: <unk> <s> </s>, the 256 byte tokens,
    then pieces with "▁" for a space, each with a score (higher merges first); BOS added."""
    words = ["▁the", "▁quick", "▁brown", "▁fox", "▁hello", "▁world", "▁mcpd", "▁cache", "▁blocks",
             "▁a", "▁t", "▁th", "he", "ll", "llo", "▁he", "▁w", "or", "ld", "▁wor", "qu", "ick", "▁q",
             "▁b", "ro", "own", "▁br", "ox", "▁f", "ca", "che", "▁c", "bl", "ock", "▁bl", "▁m", "cp", "pd"]
    letters = sorted({c for w in words for c in w})
    pieces = letters + [w for w in words if w not in letters]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)   # unknown, control, byte, normal
    add_sentencepiece(writer, pre, tokens, scores, types)


def add_sentencepiece(writer: gguf.GGUFWriter, pre: str, tokens: list[str], scores: list[float],
                      types: list[int]) -> None:
    """A SentencePiece vocabulary whose first three tokens are <unk>, <s> and </s>; BOS added."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)

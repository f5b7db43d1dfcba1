"""Tiny random Hugging Face checkpoints for tests: written by transformers, read by mcpd.

Each is a real model directory (config.json, safetensors weights, tokenizer.json made with the
tokenizers library, tokenizer_config.json with a chat template), small enough (hidden 64, 2 layers)
that loading and generating take milliseconds.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 320
BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                 "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")
CHATML = ("<|im_start|>", "<|im_end|>")   # role markers that are special tokens, as in Qwen's tokenizers
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello mcpd",
          "paged attention keeps the kv cache in blocks", "continuous batching runs every sequence",
          "tokens stream out one step at a time", "ünïcödé and 漢字 and emoji 🙂 too"] * 4

_ARCHITECTURES = {
    # kind: (config class, model class, config overrides)
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              {"head_dim": 32}),  # head_dim * heads != hidden: head_dim must come from config.json
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               {"max_position_embeddings": 256,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              {"tie_word_embeddings": True, "rope_theta": 1_000_000.0}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 4096}),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, {}),
}
KINDS = tuple(_ARCHITECTURES)
# Variants of the kinds above that real checkpoints use (tests/test_model_variants.py).
_ARCHITECTURES |= {
    "gpt2_untied": (transformers.GPT2Config, transformers.GPT2LMHeadModel, {"tie_word_embeddings": False}),
    "qwen2_untied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": False}),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
    # sliding windows far below the prompts' lengths: every layer's, and Qwen2's second layer's only
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 6}),
    "qwen2_window": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1}),
    # rope scaling, with prompts past the trained length where that length matters
    "llama_linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                     {"max_position_embeddings": 64, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama_dynamic": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                      {"max_position_embeddings": 32, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}),
    "qwen2_yarn": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                   {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama_longrope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                       {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                                         "short_factor": [1.0 + i / 8 for i in range(8)],
                                         "long_factor": [1.0 + i for i in range(8)]}}),
    # families after Llama and Qwen2
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3_plain": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 2}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
             {"sliding_window": 12, "original_max_position_embeddings": 32, "pad_token_id": 2,
              "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                               "long_factor": [1.0 + i for i in range(8)]}}),
    # soft-capped scores and logits, local layers (window 7) between global ones, Gemma 3 with
    # a scaled rope of its own on the global layers
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 7, "num_hidden_layers": 3,
                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 7, "num_hidden_layers": 3,
                "sliding_window_pattern": 2,
                "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
}
VARIANTS = tuple(kind for kind in _ARCHITECTURES if kind not in KINDS)
# Neither a kind nor a variant: every matrix's inputs a multiple of 256, for GGUF's k-quant
# super-blocks (tests/tiny_gguf.py).
_ARCHITECTURES["llama_wide"] = (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                                {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64})


def tokenizer_json(chatml: bool = False) -> Tokenizer:
    """A byte-level BPE trained in memory on a few sentences; BOS is prepended to every encoding.
    chatml: CHATML's markers are special tokens too."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS, *(CHATML if chatml else ())],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    return tokenizer


def write_tokenizer(directory: Path, chat_template: str | None = CHAT_TEMPLATE, chatml: bool = False) -> Tokenizer:
    """chatml: CHATML's special tokens and CHATML_TEMPLATE (instead of `chat_template`)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_json(chatml)
    chat_template = CHATML_TEMPLATE if chatml else chat_template
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"content": EOS, "special": True}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer


def hf_config(kind: str):
    config_class, _, overrides = _ARCHITECTURES[kind]
    if config_class is transformers.GPT2Config:
        return config_class(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                            bos_token_id=0, eos_token_id=1, initializer_range=0.2, **overrides)
    return config_class(**{
        "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "bos_token_id": 0, "eos_token_id": 1, "initializer_range": 0.2, **overrides})


def make_checkpoint(directory: Path, kind: str, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | None = None, seed: int = 0, chatml: bool = False) -> Path:
    """Write a random `kind` model (one of KINDS or VARIANTS) and a tokenizer (chatml: write_tokenizer's)
    into directory; return it."""
    _, model_class, _ = _ARCHITECTURES[kind]
    torch.manual_seed(seed)
    model = model_class(hf_config(kind)).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    write_tokenizer(directory, chatml=chatml)
    return directory


def edited_copy(source: Path, path: Path, **changes) -> Path:
    """A copy of the checkpoint at source with config.json's keys changed (None: removed)."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def load_hf(directory: Path, dtype: torch.dtype = torch.float32):
    """The reference: the checkpoint loaded by transformers, generating until max_new_tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # compare full lengths; mcpd runs with ignore_eos
    return model

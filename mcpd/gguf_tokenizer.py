"""The tokenizer a GGUF file carries, built as a `tokenizers` Tokenizer from its metadata, with
its chat template served as a checkpoint's is (tokenizer.HFTokenizer.from_gguf). Free of torch:
the scheduler tokenizes with it.

Two kinds, as llama.cpp reads them: tokenizer.ggml.model "gpt2" (byte-level BPE with the file's
merges, text split first as tokenizer.ggml.pre names) and "llama" (SentencePiece: BPE over "▁"
pieces with byte fallback, its merges derived from the token scores where the file has none).
The result equals what transformers builds from the same file; for "smollm" it also splits
digits one by one, as llama.cpp (and SmolLM's own tokenizer.json) do and transformers does not.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from mcpd.bad_gguf import BadGGUF
from mcpd.gguf_file import strings, value

CONTROL, USER_DEFINED = 3, 4   # tokenizer.ggml.token_type values

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regular expressions text is split by, in turn, before BPE.
PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT), "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,), "llama3": (_LLAMA3_SPLIT,), "smaug-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,), "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}


@dataclass
class GGUFTokenizerParts:
    """What tokenizer.HFTokenizer.from_gguf serves: the Tokenizer, its special tokens and chat template."""
    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: set[int]
    chat_template: str | None


def parts(metadata, path: Path) -> GGUFTokenizerParts:
    """The tokenizer of the GGUF file `metadata` reads (gguf_file.open_gguf(path)); ValueError naming
    the file where its metadata cannot make one."""
    try:
        tokenizer, specials = build(metadata)
        template = value(metadata, "tokenizer.chat_template", str)
    except BadGGUF as e:
        raise ValueError(f"{path}: {e}") from None
    eos_ids = {i for i in (specials["eos"], specials["eot"]) if i is not None}
    return GGUFTokenizerParts(tokenizer, _token(specials, "bos"), _token(specials, "eos"), eos_ids, template)


def build(metadata) -> tuple[Tokenizer, dict]:
    """The Tokenizer, and the special token ids the file names (bos, eos, eot, unk, pad: None where
    it names none) with its "tokens"; BadGGUF where the metadata is missing, lies or names a kind
    of tokenizer not built here."""
    kind = value(metadata, "tokenizer.ggml.model", str)
    tokens = strings(metadata, "tokenizer.ggml.tokens")
    if not tokens:
        raise BadGGUF("no tokenizer.ggml.tokens")
    types = value(metadata, "tokenizer.ggml.token_type", list, [])
    merges = strings(metadata, "tokenizer.ggml.merges")
    if kind == "gpt2":
        tokenizer = _byte_level(tokens, merges or [], value(metadata, "tokenizer.ggml.pre", str, "default"))
    elif kind == "llama":
        scores = value(metadata, "tokenizer.ggml.scores", list)
        if merges is None and (scores is None or len(scores) != len(tokens)):
            raise BadGGUF("a llama tokenizer needs tokenizer.ggml.merges or one score per token")
        tokenizer = _sentencepiece(tokens, merges, scores, value(metadata, "tokenizer.ggml.add_space_prefix", bool, True))
    else:
        raise BadGGUF(f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)")
    specials = {name: _token_id(metadata, f"tokenizer.ggml.{key}_token_id", len(tokens))
                for name, key in (("bos", "bos"), ("eos", "eos"), ("eot", "eot"), ("unk", "unknown"),
                                  ("pad", "padding"))}
    specials["tokens"] = tokens
    _add_special_tokens(tokenizer, tokens, types, specials, byte_level=kind == "gpt2")
    _add_bos_eos(tokenizer, specials, value(metadata, "tokenizer.ggml.add_bos_token", bool, kind == "llama"),
                 value(metadata, "tokenizer.ggml.add_eos_token", bool, False))
    return tokenizer, specials


def _byte_level(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    splits = PRE_TOKENIZERS.get(pre)
    if splits is None:
        raise BadGGUF(f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _byte_spelling()
    # A token written in plain text rather than the byte alphabet is spelled in it (transformers does too).
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    tokenizer = _bpe(vocab, merges, {})
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores: list | None, prefix_space: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [m.split(" ", 1) for m in merges] if merges is not None else _merges_by_score(vocab, tokens, scores)
    tokenizer = _bpe(vocab, pairs, {"fuse_unk": True, "byte_fallback": True})
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix_space
                                                       else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix_space else []))
    return tokenizer


def _bpe(vocab: dict[str, int], merges: list, options: dict) -> Tokenizer:
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    if any(len(p) != 2 or p[0] not in vocab or p[1] not in vocab for p in pairs):
        raise BadGGUF("tokenizer.ggml.merges names a token that is not in the vocabulary")
    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=pairs, **options))
    except Exception as e:   # the Rust side says what it found wrong
        raise BadGGUF(f"unusable tokenizer ({e})") from None


def _merges_by_score(vocab: dict[str, int], tokens: list[str], scores: list) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, the
    higher-scored token's first, then the shorter left and right pieces last (as transformers)."""
    if not all(type(s) in (int, float) for s in scores):
        raise BadGGUF("tokenizer.ggml.scores: expected numbers")
    found = []
    for token, score in dict(zip(tokens, scores)).items():
        splits = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        found += sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))
    found.sort(key=lambda s: (s[2], len(s[0]), len(s[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list, specials: dict, byte_level: bool) -> None:
    """Control tokens (and the ones the file names bos, eos, ...) are matched whole as special
    tokens, user-defined ones whole as text. A byte-level control token outside the byte
    alphabet is a mislabel in llama.cpp's files, and left as it is."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    named = {specials[k] for k in ("bos", "eos", "eot", "unk", "pad") if specials[k] is not None}
    control = [t for i, (t, kind) in enumerate(zip(tokens, types))
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    control += [tokens[i] for i in sorted(named) if tokens[i] not in control]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _add_bos_eos(tokenizer: Tokenizer, specials: dict, add_bos: bool, add_eos: bool) -> None:
    bos, eos = _token(specials, "bos") if add_bos else None, _token(specials, "eos") if add_eos else None
    if bos is None and eos is None:
        return
    single = ([bos] if bos else []) + ["$A"] + ([eos] if eos else [])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, tokenizer.token_to_id(t)) for t in {bos, eos} - {None}])


def _token_id(metadata, key: str, count: int) -> int | None:
    token_id = value(metadata, key, int)
    if token_id is not None and not 0 <= token_id < count:
        raise BadGGUF(f"{key} = {token_id}: not one of the {count} tokens")
    return token_id


def _token(specials: dict, name: str) -> str | None:
    token_id = specials[name]
    return specials["tokens"][token_id] if token_id is not None else None


def _byte_spelling() -> dict[int, str]:
    """GPT-2's bytes-to-unicode table: printable bytes stand for themselves, the rest are moved
    to code points from 256 up."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}

"""The examples' WordPiece tokenizer (BERT's scheme, built with the `tokenizers` package) over a
vocabulary generated in code: letters, digits, punctuation and consonant/vowel syllables, each
also as a word's continuation ("##"). No file is fetched, and the same code gives the same ids
on every machine, so a test can rebuild what a worker serves.

The special tokens are in the vocabulary only, not added as special tokens: a client's text
"[CLS]" is split into pieces like any other text and cannot forge one.
"""
from __future__ import annotations

import string

import numpy as np
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD_ID = 0   # what the batcher pads a variable dim with: zeros
CONSONANTS = "bcdfghjklmnpqrstvwxyz"
VOWELS = "aeiou"


def vocabulary() -> dict[str, int]:
    """Token -> id, the same on every call."""
    pieces = list(string.ascii_lowercase + string.digits)
    pieces += [c + v for c in CONSONANTS for v in VOWELS] + [v + c for v in VOWELS for c in CONSONANTS]
    pieces += [c + v + e for c in CONSONANTS for v in VOWELS for e in CONSONANTS]
    tokens = [*SPECIALS, *string.punctuation, *pieces, *("##" + p for p in pieces)]
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer(max_length: int) -> Tokenizer:
    """Lower-cased, accents stripped, [CLS] text [SEP], cut to max_length ids (the model's positions)."""
    vocab = vocabulary()
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.enable_truncation(max_length)
    return tokenizer


def token_ids(tokenizer: Tokenizer, texts: np.ndarray) -> np.ndarray:
    """int64 [rows, longest row] for a 1-D array of UTF-8 bytes (bytes that are not UTF-8 become
    U+FFFD), shorter rows padded with PAD_ID."""
    encodings = tokenizer.encode_batch([bytes(t).decode("utf-8", "replace") for t in texts])
    ids = np.full((len(encodings), max((len(e.ids) for e in encodings), default=0)), PAD_ID, np.int64)
    for row, encoding in enumerate(encodings):
        ids[row, :len(encoding.ids)] = encoding.ids
    return ids

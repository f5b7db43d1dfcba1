"""Special-token text in chat messages, kept from becoming special tokens.

A tokenizer reads the text of a special token (`<|im_start|>`) as that token wherever it stands,
so a client who writes a template's role markers into a message would forge a turn (a system
prompt, say). Before the template runs, every such text in the messages' strings becomes a
placeholder no client can guess; the rendered prompt is then cut at the special tokens left, all
the template's own, and the text between them (each placeholder given its text back) is encoded
with special-token parsing off. Messages with no special-token text skip all of it: their
tokens are the tokenizer's for the rendered prompt, as transformers' apply_chat_template gives.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Masked:
    """Messages whose special-token texts are placeholders, and those texts in order."""
    messages: list
    placeholder: re.Pattern   # matches one placeholder; its group 1 is the index into `texts`
    texts: list[str]

    def unmask(self, text: str) -> str:
        return self.placeholder.sub(lambda m: self.texts[int(m[1])], text)


class SpecialText:
    def __init__(self, ids: dict[str, int]):
        """ids: each special token's text and id (a tokenizer's added tokens marked special)."""
        self.ids = ids
        longest_first = sorted((t for t in ids if t), key=len, reverse=True)   # as tokenizers match them
        self.pattern = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if longest_first else None

    def mask(self, messages: list) -> Masked | None:
        """The messages with every special-token text in their strings replaced; None when they
        have none (then nothing changes)."""
        if self.pattern is None:
            return None
        nonce = secrets.randbelow(10 ** 18)   # digits: a template's upper or lower leaves them as they are
        texts: list[str] = []

        def hide(found: re.Match) -> str:
            texts.append(found[0])
            return f"\ue000{nonce}:{len(texts) - 1}\ue001"

        masked = [{k: self.pattern.sub(hide, v) if isinstance(v, str) else v for k, v in m.items()}
                  if isinstance(m, dict) else m for m in messages]
        return Masked(masked, re.compile(f"\ue000{nonce}:(\\d+)\ue001"), texts) if texts else None

    def pieces(self, rendered: str, masked: Masked) -> list[str | int]:
        """The prompt rendered from masked messages, cut at the template's special tokens: their
        ids, and between them the text (placeholders unmasked) to encode without special tokens."""
        parts = self.pattern.split(rendered)   # texts at even indices, the special tokens at odd ones
        return [self.ids[part] if i % 2 else masked.unmask(part) for i, part in enumerate(parts)]

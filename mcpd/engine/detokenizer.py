"""Incremental detokenization with stop strings.

Token ids turn into text a few at a time, and two things make the new text not yet final:
- a token may end in the middle of a UTF-8 character (byte-level vocabularies split them), which
  decodes to U+FFFD until the rest arrives;
- the text may end with the beginning of a stop string, which must never reach the client if the
  stop string completes.
Both are withheld until resolved, so the concatenation of every delta is exactly the final text.

Decoding re-reads only a short window of recent tokens (the approach of vLLM and TGI): decoding
the window with and without the newest tokens and taking the difference keeps tokenizers that
glue or strip spaces at word boundaries (sentencepiece) correct, at a constant cost per token.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # mcpd.models imports torch, which mcpd.cpu.threads must be able to precede
    from mcpd.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens that seed the window, so the first output token decodes in context


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0                  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already in self.text
        self.text = ""                          # decoded output so far (cut at a stop string)
        self.sent = 0                           # chars of self.text already handed out
        self.stopped = False                    # a stop string completed

    def add(self, token_id: int) -> None:
        """Append one generated token; sets `stopped` when a stop string completes."""
        self.token_ids.append(token_id)
        window = self.token_ids[self.prefix_offset:]
        before = self.tokenizer.decode(window[:self.read_offset - self.prefix_offset])
        after = self.tokenizer.decode(window)
        if after.endswith("\ufffd"):
            return  # a character still incomplete
        new_from = self._new_from(before, after)
        if len(after) <= new_from:
            return  # nothing yet
        self._extend(after[new_from:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    @staticmethod
    def _new_from(before: str, after: str) -> int:
        """Where the new text begins in after. Only the prompt can leave before ending in an
        incomplete character (U+FFFD): output bytes that complete it turn that U+FFFD into the
        character, which is the output's text (the bytes that finish it are the output's)."""
        if not before.endswith("\ufffd") or after.startswith(before):
            return len(before)
        return len(os.path.commonprefix([before, after]))

    def take(self, final: bool) -> str:
        """New text for the client. final: no more tokens will come, so release what was withheld
        (an incomplete character becomes U+FFFD, a partial stop string is just text)."""
        if final and not self.stopped and self.read_offset < len(self.token_ids):
            window = self.token_ids[self.prefix_offset:]
            before = self.tokenizer.decode(window[:self.read_offset - self.prefix_offset])
            self._extend(self.tokenizer.decode(window)[len(before):])
            self.read_offset = len(self.token_ids)
        end = len(self.text) if final or self.stopped else len(self.text) - self._partial_stop()
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def _extend(self, delta: str) -> None:
        if self.stopped:
            return
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        return max((n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])),
                   default=0)

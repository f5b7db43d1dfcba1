"""What a generate answers: its final result and its stream chunks, declared once.

The worker builds them, the scheduler passes a context turn's on (adding `context`), and the
bundled clients and the HTTP listener decode them. Each encodes as the msgpack map that
docs/PROTOCOL.md describes (section 4, generate); a field at its default (None) is left out.
"""
from __future__ import annotations

import msgspec


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int


class Degraded(msgspec.Struct, frozen=True):
    """The degradation ladder shortened the request (scheduler/degradation.py)."""
    max_tokens: int
    requested_max_tokens: int


class ContextTurn(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a generate on a context made of it: the version it committed and the tokens it added."""
    id: str
    version: int
    appended_token_ids: list[int]
    kept_tokens: int | None = None   # a chat turn that replaced the tail: the tokens it kept before them


class GenerateResult(msgspec.Struct, frozen=True, omit_defaults=True):
    text: str
    token_ids: list[int]
    finish_reason: str
    model: str                 # the model table's names of what ran it
    version: str
    usage: Usage
    logprobs: list[float] | None = None       # only when asked for
    degraded: Degraded | None = None
    context: ContextTurn | None = None        # a generate on a context

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens


class GenerateChunk(msgspec.Struct, frozen=True, omit_defaults=True):
    """One streamed piece of a generation: what it produced since the previous chunk."""
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None


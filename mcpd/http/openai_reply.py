"""mcpd results in OpenAI's response shapes: whole answers and streamed chunks (socket-free).

A chat answer is a `chat.completion` (streamed: `chat.completion.chunk`s, the first carrying the
assistant role); a completion is a `text_completion` either way. Every final answer carries
`usage`; a stream does when asked (`stream_options.include_usage`): one last chunk with no
choices. Log-probabilities name tokens as "token_id:N" (the engine reports ids, not strings).
On a context, the committed version rides along as `mcpd_context` ({"id", "version"}).
"""
from __future__ import annotations

import os
import time

from mcpd.protocol.results import GenerateChunk, GenerateResult


class Answer:
    """The fixed parts of one request's answer: its id, creation time, model and kind."""

    def __init__(self, model: str, chat: bool):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, result: GenerateResult) -> dict:
        """The non-streamed answer from generate's final result."""
        choice = {"index": 0, "finish_reason": result.finish_reason,
                  "logprobs": _logprobs(self.chat, result.token_ids, result.logprobs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return {**self._head(False), "choices": [choice], "usage": usage(result), **_context(result)}

    def chunk(self, data: GenerateChunk, first: bool, include_usage: bool) -> dict:
        """One streamed piece (generate's chunk data)."""
        choice = {"index": 0, "finish_reason": None, "logprobs": _logprobs(self.chat, data.token_ids, data.logprobs)}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": data.text} if first else {"content": data.text}
        else:
            choice["text"] = data.text
        return {**self._head(True), "choices": [choice], **({"usage": None} if include_usage else {})}

    def last_chunks(self, result: GenerateResult, include_usage: bool) -> list[dict]:
        """The closing chunk (finish_reason) and, if asked, the usage chunk."""
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        chunks = [{**self._head(True), "choices": [choice], **_context(result),
                   **({"usage": None} if include_usage else {})}]
        if include_usage:
            chunks.append({**self._head(True), "choices": [], "usage": usage(result)})
        return chunks


def usage(result: GenerateResult) -> dict:
    prompt, completion = result.prompt_tokens, result.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _context(result: GenerateResult) -> dict:
    context = result.context
    return {"mcpd_context": {"id": context.id, "version": context.version}} if context else {}


def _logprobs(chat: bool, token_ids: list[int], logprobs: list[float] | None) -> dict | None:
    if logprobs is None:
        return None
    tokens = [f"token_id:{t}" for t in token_ids]
    if chat:
        return {"content": [{"token": t, "logprob": p, "bytes": None, "top_logprobs": []}
                            for t, p in zip(tokens, logprobs)]}
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}

"""A chat on a context: the conversation the context's tokens hold, kept beside them, so that a
chat turn leaves the context with exactly the tokens a stateless client gets for the whole
message list (`encode_chat(all messages)`, ending with the next turn's generation prompt).

Why the whole conversation is rendered and tokenized at every turn, rather than the new messages
alone: a template's text for a message depends on the others (SmolLM2's adds its default system
prompt only before the first; the close after an answer, `<|im_end|>\\n` in ChatML, is written by
the template when the next turn renders the answer, not by the model), and a BPE tokenizer may
merge tokens across any boundary in the text that is not a special token. Rendering the whole
conversation as text and tokenizing it whole is what the stateless client's request does, so no
argument about where merges may happen is needed: the turn's tokens are those by construction.

The turn then keeps the longest common prefix of the chat's tokens and the conversation's, and
prefills only the rest (the worker's prefix cache holds the KV of what is kept): it runs on the
kept tokens, equal to the conversation's first ones, then the conversation's remaining ones, which
is the conversation's tokens exactly (after the tokens the context held before the chat began,
none for a context that began with it). That prefix is all the chat's tokens when the last
answer's tokens are the tokenizer's spelling of its text, the usual case, whether the answer was
ended by the template's own end token (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`) or cut by
`max_tokens` (the template closes the partial answer, as it closes the one a stateless client
sends back): the template's text after an answer starts at a special token, where no merge
reaches across. It is shorter where the stored tail is not what the client sends back: an end
token the template does not write (the embedded template closes an answer with "\\n", not EOS), the
tokens of a stop string (not in the text), a character cut in half (U+FFFD in the text), a
template that rewrites the answer (Llama 3's trims it), a spelling of the answer the tokenizer
would not produce: those tail tokens are replaced by the conversation's own.

The record is the context field `mcpd.chat` (msgpack: start, end, messages): the chat's tokens are
tokens[start:end]. A context whose token count is not `end` was changed by something else since
(a prompt turn, an update of its tokens): the next chat turn starts a new chat after its tokens.
The field is the tenant's to read and to write, so it is decoded as hostile input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from mcpd.contexts.context import Context
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.tokenizer import Tokenizer

FIELD = "mcpd.chat"


class ChatRecord(msgspec.Struct, forbid_unknown_fields=True):
    start: Annotated[int, msgspec.Meta(ge=0)]
    end: Annotated[int, msgspec.Meta(ge=0)]
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class ChatTurn:
    """What a chat turn runs on: the context's first `keep` tokens, then `prompt_ids`."""
    keep: int
    prompt_ids: list[int]
    start: int                 # where the chat begins in the context's tokens
    conversation: list[dict]   # every message so far, the new ones last

    def record(self, answer: str, end: int) -> bytes:
        """The field's value once the turn's `answer` is committed and the tokens end at `end`."""
        messages = [*self.conversation, {"role": "assistant", "content": answer}]
        return msgspec.msgpack.encode(ChatRecord(self.start, end, messages))


def next_turn(tokenizer: Tokenizer, context: Context, messages: list[dict]) -> ChatTurn:
    """The turn that adds `messages` to the context's chat. Raises MCPDError BAD_REQUEST for a
    record the tenant spoiled; ValueError for messages the template refuses."""
    record = _record_of(context)
    conversation = [*record.messages, *messages]
    whole = tokenizer.encode_chat(conversation)
    same = _common_prefix(context.tokens[record.start:], whole)
    return ChatTurn(record.start + same, whole[same:], record.start, conversation)


def _record_of(context: Context) -> ChatRecord:
    """The context's chat, or a new one after its tokens when it has none or they changed since."""
    count = len(context.tokens)
    value = context.fields.get(FIELD)
    if value is None:
        return ChatRecord(count, count, [])
    try:
        record = msgspec.msgpack.decode(value, type=ChatRecord) if isinstance(value, bytes) else None
    except (msgspec.MsgspecError, RecursionError):
        record = None
    if record is None or record.start > record.end:
        raise MCPDError(codes.BAD_REQUEST, f"context field {FIELD!r} is not a chat record mcpd wrote: "
                                           "delete it to start a new chat")
    return record if record.end == count else ChatRecord(count, count, [])


def _common_prefix(held: np.ndarray, whole: list[int]) -> int:
    n = min(len(held), len(whole))
    differs = np.flatnonzero(held[:n] != np.asarray(whole[:n], held.dtype))
    return int(differs[0]) if differs.size else n

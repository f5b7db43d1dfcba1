"""A generate's prompt as token ids, made once, in the scheduler.

The scheduler tokenizes because it is where a prompt's length is needed: admission, the length
bins of batching and routing count real tokens, not characters. The front-end would be the other
place, but it is every client's I/O (and every worker's replies): a long prompt tokenized there
would hold up all of them, while the scheduler's other work per request is small and fixed. The
ids travel in the Dispatch, so the worker does not tokenize again.
"""
from __future__ import annotations

from mcpd.contexts import chat
from mcpd.contexts.context import Context
from mcpd.protocol import codes
from mcpd.protocol.args import GenerateArgs
from mcpd.protocol.codes import MCPDError
from mcpd.tokenizer import Tokenizer


def prompt_token_ids(tokenizer: Tokenizer, args: GenerateArgs, opens_sequence: bool, limit: int) -> list[int]:
    """The new prompt tokens of a generate. opens_sequence: nothing comes before them (not a
    turn appended to a context's history), so special tokens (BOS) open them. Raises MCPDError
    BAD_REQUEST for a chat the template refuses or a prompt over `limit` tokens; token ids given
    as such are used as given (the engine checks them against the vocabulary)."""
    if not args.has_prompt:
        return []   # a context turn that continues the context as it is
    if args.prompt_token_ids is not None:
        return list(args.prompt_token_ids)
    try:
        if args.prompt is not None:
            ids = tokenizer.encode(args.prompt, add_special_tokens=opens_sequence)
        else:
            ids = tokenizer.encode_chat(list(args.messages))
    except ValueError as e:
        raise MCPDError(codes.BAD_REQUEST, str(e)) from None
    return _within(ids, limit)


def chat_turn(tokenizer: Tokenizer, context: Context, args: GenerateArgs, limit: int) -> chat.ChatTurn:
    """A turn of messages on a context (contexts/chat.py); `limit` bounds the tokens it adds."""
    try:
        turn = chat.next_turn(tokenizer, context, list(args.messages))
    except ValueError as e:
        raise MCPDError(codes.BAD_REQUEST, str(e)) from None
    _within(turn.prompt_ids, limit)
    return turn


def _within(ids: list[int], limit: int) -> list[int]:
    if len(ids) > limit:
        raise MCPDError(codes.BAD_REQUEST, f"prompt is {len(ids)} tokens; the limit is {limit}")
    return ids

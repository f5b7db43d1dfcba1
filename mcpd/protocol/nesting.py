"""How deep a payload value nests. Payload the daemon carries unread to user code (a chat
message's keys besides role and content, a handler's settings) is held to MAX_DEPTH where it
enters: every process that passes it on encodes it recursively, and a value near Python's
recursion limit would stop the sender with a RecursionError instead of a refusal."""
from __future__ import annotations

MAX_DEPTH = 32   # far above a chat template's tool calls or a handler's settings tables


def nests_within(value, limit: int = MAX_DEPTH) -> bool:
    """Whether `value`'s maps, lists and tuples nest at most `limit` deep (a scalar: 0). Looks
    at each level in turn, never recursing itself."""
    level = [value]
    for _ in range(limit + 1):
        level = [child for item in level for child in _children(item)]
        if not level:
            return True
    return False


def _children(value) -> list:
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        return list(value)
    return []

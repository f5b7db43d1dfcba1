"""Prefix reuse below the block: which KV block's leading rows hold the keys and values of a chain
parent (the hash of every full block before it, kv_cache.py) followed by given tokens, for any
count of tokens short of a whole block.

Whole blocks are shared by their chained hash; a prompt's last, partial block never is, so
without this a prompt that repeats a cached one recomputes up to a block of tokens (all of a
2-token prompt). Here every block that holds known tokens registers a key per leading count of
them, the parent's hash extended token by token (BLAKE2b, as the chain: a collision would hand
one prompt another's keys and values). A lookup tries the new prompt's own keys, longest first,
so it costs one digest per token of the block whatever the number of blocks registered.

A key names the block that registered it first; a block forgets only its own keys, so a key may
go while another block still holds its tokens: a missed reuse, never a wrong one.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

KEY_BYTES = 32


def prefix_keys(parent: bytes, token_ids: list[int]) -> list[bytes]:
    """The keys of parent + token_ids[:1], parent + token_ids[:2], ... (one per token)."""
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    data = array("q", token_ids).tobytes()
    keys = []
    for start in range(0, len(data), 8):
        digest.update(data[start:start + 8])
        keys.append(digest.copy().digest())
    return keys


class PartialBlocks:
    def __init__(self) -> None:
        self.blocks: dict[bytes, int] = {}        # prefix key -> a block whose leading rows hold it
        self.keys: dict[int, list[bytes]] = {}    # block -> the keys it registered

    def add(self, block: int, parent: bytes, token_ids: list[int]) -> bool:
        """Register block's leading rows as holding parent + token_ids; whether any key was new."""
        new = [key for key in prefix_keys(parent, token_ids) if key not in self.blocks]
        for key in new:
            self.blocks[key] = block
        if new:
            self.keys.setdefault(block, []).extend(new)
        return bool(new)

    def drop(self, block: int) -> None:
        """block's rows may change from now on: forget the keys it registered."""
        for key in self.keys.pop(block, ()):
            del self.blocks[key]

    def longest(self, parent: bytes, token_ids: list[int], usable: Callable[[int], bool]) -> tuple[int | None, int]:
        """(block, rows): a usable block whose first `rows` rows hold parent + token_ids[:rows],
        rows as many as any has; (None, 0) if none holds even the first token."""
        keys = prefix_keys(parent, token_ids)
        for rows in range(len(keys), 0, -1):
            block = self.blocks.get(keys[rows - 1])
            if block is not None and usable(block):
                return block, rows
        return None, 0

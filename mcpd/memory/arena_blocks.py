"""The arena's small entries: size classes of blocks, and pages cut into one class's blocks.

A class k holds blocks of 2^(min_shift + k - 1) bytes, from 64 bytes (or page/256, so that a
page's blocks fit its 256-bit bitmap) to half a page; class 0 stands for a chain of whole pages.
A page given to class k has page kind CHAIN + k, a bitmap of its taken blocks and their count;
it goes back to FREE with its last block. The columns are the segment's own (shm_layout.py), so
every process sees the same blocks; the arena's lock is held around every call that changes them.
"""
from __future__ import annotations

import numpy as np

FREE, CHAIN = 0, 1                    # page kinds; a page of class k's blocks is CHAIN + k
MIN_BLOCK = 64
MAX_BLOCKS_PER_PAGE = 256             # the bitmap's bits


class ArenaBlocks:
    def __init__(self, page_bytes: int, page_kind: np.ndarray, blocks_used: np.ndarray, bitmap: np.ndarray):
        self.page_bytes = page_bytes
        self.page_kind, self.blocks_used, self.bitmap = page_kind, blocks_used, bitmap
        self.min_shift = max(MIN_BLOCK, page_bytes // MAX_BLOCKS_PER_PAGE).bit_length() - 1
        self.num_classes = (page_bytes // 2).bit_length() - 1 - self.min_shift + 1

    # -- sizes ------------------------------------------------------------------------------------

    def class_of(self, nbytes: int) -> int:
        """The size class of an entry of nbytes, 1 for the smallest; 0 for a chain of pages."""
        if nbytes > self.page_bytes // 2:
            return 0
        return max(1, (max(nbytes, 1) - 1).bit_length() - self.min_shift + 1)

    def block_bytes(self, klass: int) -> int:
        return 1 << (self.min_shift + klass - 1)

    def per_page(self, klass: int) -> int:
        return self.page_bytes // self.block_bytes(klass)

    def pages_for(self, nbytes: int) -> int:
        """The pages of a chain holding nbytes."""
        return max(1, -(-nbytes // self.page_bytes))

    def held_bytes(self, klass: np.ndarray, npages: np.ndarray) -> np.ndarray:
        """What entries of these classes (and chain lengths) hold of the pages: blocks, or whole pages."""
        klass = klass.astype(np.int64)
        blocks = np.left_shift(1, self.min_shift + np.maximum(klass, 1) - 1)
        return np.where(klass > 0, blocks, npages.astype(np.int64) * self.page_bytes)

    # -- pages of blocks --------------------------------------------------------------------------

    def partial_pages(self, klass: int) -> np.ndarray:
        return np.flatnonzero((self.page_kind == CHAIN + klass) & (self.blocks_used < self.per_page(klass)))

    def take(self, klass: int) -> tuple[int, int]:
        """A free block of the class: in its fullest page that has one (so sparse pages empty
        out), else in a fresh page from the top of the range."""
        partial = self.partial_pages(klass)
        if partial.size:
            page = int(partial[np.argmax(self.blocks_used[partial])])
        else:
            page = int(np.flatnonzero(self.page_kind == FREE)[-1])
            self.page_kind[page] = CHAIN + klass
        block = self.first_free(page, klass)
        self.mark(page, block, True)
        return page, block

    def first_free(self, page: int, klass: int) -> int:
        bits = np.unpackbits(self.bitmap[page], bitorder="little")
        return int(bits[:self.per_page(klass)].argmin())

    def mark(self, page: int, block: int, taken: bool) -> None:
        """A block taken or given back; a page whose last block goes back is FREE again."""
        if taken:
            self.bitmap[page, block >> 3] |= 1 << (block & 7)
        else:
            self.bitmap[page, block >> 3] &= ~(1 << (block & 7)) & 0xFF
        self.blocks_used[page] = int(self.blocks_used[page]) + (1 if taken else -1)
        if not taken and self.blocks_used[page] == 0:
            self.page_kind[page] = FREE

    def taken(self, page: int, block: int) -> bool:
        return bool(self.bitmap[page, block >> 3] >> (block & 7) & 1)

    def sparse_classes(self) -> np.ndarray:
        """Classes whose live blocks would fit in fewer pages than they hold."""
        of_blocks = self.page_kind > CHAIN
        kinds = self.page_kind[of_blocks].astype(np.int64) - CHAIN
        pages = np.bincount(kinds, minlength=self.num_classes + 1)
        used = np.bincount(kinds, weights=self.blocks_used[of_blocks], minlength=self.num_classes + 1)
        per_page = self.page_bytes // np.left_shift(1, self.min_shift + np.arange(self.num_classes + 1) - 1).clip(1)
        return np.flatnonzero(pages > np.ceil(used / per_page))

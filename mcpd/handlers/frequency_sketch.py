"""How often each key was asked for lately, in a few bytes per key: a count-min sketch (TinyLFU's)
of small saturating counters, all halved every `sample_size` additions so that old popularity
fades. The result cache asks it whether a newcomer is worth its victim's place."""
from __future__ import annotations

import numpy as np

ROWS = 4
MAX_COUNT = 15          # 4-bit counters, as TinyLFU's: enough to rank, small enough to fade fast
_ROW_HASH_BYTES = 4     # a key's hash (a digest) gives each row its own 4 bytes


class FrequencySketch:
    def __init__(self, entries: int):
        """Sized for about `entries` keys held at once: 8 counters per key and row, halving after
        10 additions per key (TinyLFU's sample of ten times the cache)."""
        self.width = 1 << max(10, (8 * max(entries, 1) - 1).bit_length())
        self.entries = entries
        self.sample_size = 10 * max(entries, 1)
        self._counters = bytearray(ROWS * self.width)
        self._mask = self.width - 1
        self._additions = 0

    def add(self, digest: bytes) -> None:
        """Count one more request for the key whose digest (16+ random-looking bytes) this is.
        Only the counters at the key's minimum grow (conservative update): less overcounting."""
        slots = self._slots(digest)
        least = min(self._counters[slot] for slot in slots)
        if least < MAX_COUNT:
            for slot in slots:
                if self._counters[slot] == least:
                    self._counters[slot] = least + 1
        self._additions += 1
        if self._additions >= self.sample_size:
            self._halve()

    def estimate(self, digest: bytes) -> int:
        return min(self._counters[slot] for slot in self._slots(digest))

    def _slots(self, digest: bytes) -> list[int]:
        return [row * self.width + (int.from_bytes(digest[at:at + _ROW_HASH_BYTES], "little") & self._mask)
                for row, at in enumerate(range(0, ROWS * _ROW_HASH_BYTES, _ROW_HASH_BYTES))]

    def _halve(self) -> None:
        counters = np.frombuffer(self._counters, np.uint8)
        counters >>= 1
        self._additions //= 2

"""A token bucket: `rate` tokens a second, holding at most `burst`; one request takes one token."""
from __future__ import annotations


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)   # a new client may send a full burst at once
        self.stamp = now

    def configure(self, rate: float, burst: int) -> None:
        """New limits (a reload): the client keeps what it has, up to the new burst."""
        self.rate, self.burst = rate, burst
        self.tokens = min(self.tokens, float(burst))

    def take(self, now: float) -> float:
        """Take a token: 0.0 when granted, else the seconds until one will be there."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst

    def _refill(self, now: float) -> None:
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

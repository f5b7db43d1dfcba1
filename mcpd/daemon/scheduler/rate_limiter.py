"""Per-client rate limits: one token bucket per (client identity, priority class).

The identity is the header's tenant, which the front-end overwrites with the authenticated
identity once authentication exists, so a client cannot escape its bucket by renaming itself.
Buckets of idle clients are full; those are forgotten when the table grows, so a stream of
made-up identities costs bounded memory (a forgotten bucket comes back full, as it was).
"""
from __future__ import annotations

from mcpd.config import PriorityClass
from mcpd.daemon.scheduler.token_bucket import TokenBucket

MAX_BUCKETS = 65536


class RateLimiter:
    def __init__(self, classes: dict[str, PriorityClass]):
        self.classes = classes
        self.buckets: dict[tuple[str, str], TokenBucket] = {}

    def configure(self, classes: dict[str, PriorityClass]) -> None:
        self.classes = classes
        for (client, name), bucket in list(self.buckets.items()):
            limits = classes.get(name)
            if limits is None or limits.rate == 0:
                del self.buckets[(client, name)]
            else:
                bucket.configure(limits.rate, limits.burst)

    def check(self, client: str, class_name: str, now: float) -> float:
        """0.0 when the request may go on, else the seconds the client should wait."""
        limits = self.classes[class_name]
        if limits.rate == 0:
            return 0.0
        bucket = self.buckets.get((client, class_name))
        if bucket is None:
            if len(self.buckets) >= MAX_BUCKETS:
                self._forget_idle(now)
            bucket = self.buckets[(client, class_name)] = TokenBucket(limits.rate, limits.burst, now)
        return bucket.take(now)

    def _forget_idle(self, now: float) -> None:
        for key, bucket in list(self.buckets.items()):
            if bucket.full(now):
                del self.buckets[key]

"""The cluster's recently used contexts, in Redis: one sorted set of context tags (context_keys.py)
by the Redis time of their last change, trimmed to the newest cluster.recent_contexts. A node that
starts or takes over contexts reads it to prefetch the ones it now owns (prefetch.py), and
`mcpctl cluster` counts each node's share of it.

    mcpd:{recent}   sorted set: "<tenant>:<id>" -> the Redis time (ms) of its last open or commit
                    (or just after the newest stamp: see RECORD)

Nodes write it from their heartbeat thread, a beat's changes at once, never on a commit's path: an
index a beat behind costs a prefetch one context, not every commit a round trip. Every entry read
back is checked (parse_tag) and one that no node could have written is skipped.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import redis

from mcpd.cluster.context_keys import parse_tag, tag_of

KEY = "mcpd:{recent}"
PAGE = 1000

# KEYS: the set. ARGV: the bound, how many tags to stamp (the oldest use first), those tags, then
# the tags to forget. Each stamp is Redis's time in ms, or one past the newest stamp when that is
# later (uses come faster than one a ms), so the order of uses is strict. Returns the set's size.
RECORD = """
local now = redis.call('TIME')
local stamp = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local newest = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
if newest and tonumber(newest) >= stamp then stamp = tonumber(newest) + 1 end
local stamped = tonumber(ARGV[2])
for i = 3, 2 + stamped do redis.call('ZADD', KEYS[1], stamp + i - 3, ARGV[i]) end
for i = 3 + stamped, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[1]) + 1))
return redis.call('ZCARD', KEYS[1])
"""


class RecentContexts:
    def __init__(self, client: redis.Redis, bound: int):
        self.redis, self.bound = client, bound
        self.record_script = client.register_script(RECORD)

    def record(self, used: Iterable[tuple[str, str]], dropped: Iterable[tuple[str, str]]) -> int:
        """Stamp `used` now and forget `dropped`; returns how many the index holds. Raises redis.RedisError."""
        used, dropped = [tag_of(*key) for key in used], [tag_of(*key) for key in dropped]
        return self.record_script(keys=[KEY], args=[self.bound, len(used), *used, *dropped])

    def newest(self) -> Iterator[tuple[str, str]]:
        """The (tenant, id) of each indexed context, the most recently used first, a page at a time."""
        for start in range(0, self.bound, PAGE):
            page = self.redis.zrevrange(KEY, start, min(start + PAGE, self.bound) - 1)
            yield from filter(None, map(parse_tag, page))
            if len(page) < PAGE:
                return

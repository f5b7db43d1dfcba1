"""The cluster's recency index in a real redis-server (mcpd/cluster/recency.py), in this process:
the newest use first, bounded, drops forgotten, and entries no node could have written skipped."""
from mcpd.cluster.context_keys import parse_tag, tag_of
from mcpd.cluster.recency import KEY, RecentContexts


def test_the_newest_use_comes_first_the_index_keeps_its_bound_and_forgets_drops(redis_server):
    index = RecentContexts(redis_server.client(), bound=3)
    # Used against the names' order (uses within a millisecond tie in Redis's clock, and a tie
    # comes back in the names' reverse order): only the index's own order of uses passes.
    index.record([("t", "d"), ("t", "c")], [])
    index.record([("t", "b"), ("t", "a")], [])
    assert list(index.newest()) == [("t", "a"), ("t", "b"), ("t", "c")]   # d, the oldest, trimmed
    assert index.record([("t", "c")], [("t", "b")]) == 2
    assert list(index.newest()) == [("t", "c"), ("t", "a")]


def test_entries_no_node_writes_are_skipped(redis_server):
    client = redis_server.client()
    index = RecentContexts(client, bound=100)
    index.record([("acme", "x:y{z}%")], [])
    client.zadd(KEY, {b"\xff:x": 1e15, b"a:b:c": 1e15, b"a%zz:b": 1e15, b"a%3ab:c": 1e15, b":b": 1e15,
                      b"a" * 65 + b":b": 1e15, b"a:" + b"b" * 129: 1e15, b"a" * 100_000: 1e15})
    assert list(index.newest()) == [("acme", "x:y{z}%")]


def test_a_tag_reads_back_as_the_names_it_was_made_of():
    for owner, context_id in [("acme", "chat"), ("a:b", "{c}"), ("%7B", "%"), ("ü", "名前")]:
        assert parse_tag(tag_of(owner, context_id).encode()) == (owner, context_id)

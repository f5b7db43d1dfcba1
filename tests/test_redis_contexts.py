"""Contexts in Redis (mcpd/cluster/redis_contexts.py) under the real store, host-cache-less
persistence and journal, in this process, against a real redis-server: what Redis holds after
each change, a second node's restore, folding, a node behind another, and Redis down."""
import logging
import os

import numpy as np
import pytest

from mcpd.cluster.context_keys import keys_of
from mcpd.config import from_dict
from mcpd.contexts import journal_file
from mcpd.contexts.persistence import open_store
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError
from test_storage_full import files_capped_at

LOG = logging.getLogger("test")


def node(state_dir, redis_server, **cluster):
    config = from_dict({"server": {"state_dir": str(state_dir)},
                        "cluster": {"redis": redis_server.url, "node_id": state_dir.name, **cluster}})
    return open_store(config, None, LOG)


def grow(store, owner="t", context_id="c"):
    """Three versions touching every kind of field, one deleted again."""
    store.open(owner, context_id)
    store.update(owner, context_id, 0, [codec.diff("w", None, np.arange(64, dtype=np.float32)),
                                        codec.diff("name", None, "ada"), codec.diff("n", None, 7)])
    context = store.get(owner, context_id)
    store.append_tokens(context, [5, 6, 7])
    store.update(owner, context_id, 2, [codec.delete("name"),
                                        codec.diff("w", context.fields["w"], context.fields["w"] * 2)])
    return context


def same(a, b) -> bool:
    return (a.version == b.version and a.fields.keys() == b.fields.keys()
            and all(np.array_equal(a.fields[k], b.fields[k]) if isinstance(a.fields[k], np.ndarray)
                    else a.fields[k] == b.fields[k] for k in a.fields)
            and (a.changed_at, a.deleted_at, a.token_count_at, a.tokens_rewritten_at)
            == (b.changed_at, b.deleted_at, b.token_count_at, b.tokens_rewritten_at))


def test_every_commit_is_in_redis_as_the_journal_wrote_it(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server)
    grow(first.store)
    first.journal.close()
    redis, keys = redis_server.client(), keys_of("t", "c")
    assert int(redis.hget(keys.meta, "version")) == 3
    assert journal_file.decode(redis.get(keys.snap))["version"] == 0   # the open
    journal = (tmp_path / "a/contexts/journal-0.log").read_bytes()
    log = redis.lrange(keys.log, 0, -1)
    assert [journal_file.decode(data)["version"] for data in log] == [1, 2, 3]
    assert all(data in journal for data in log)   # the journal's records, byte for byte


def test_a_node_lacking_a_context_restores_it_exactly_and_keeps_it(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server)
    made = grow(first.store)
    second = node(tmp_path / "b", redis_server)
    restored = second.store.get("t", "c")
    assert same(restored, made)
    assert codec.to_wire(restored.changes_since(1))[0] == codec.to_wire(made.changes_since(1))[0]
    second.store.update("t", "c", 3, [codec.diff("n", None, 8)])
    second.journal.close()
    alone = open_store(from_dict({"server": {"state_dir": str(tmp_path / "b")}}), None, LOG)   # no Redis now
    assert alone.store.get("t", "c").version == 4 and alone.store.get("t", "c").fields["n"] == 8
    alone.journal.close()
    first.journal.close()


def test_a_long_log_is_folded_into_a_snapshot(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server, compact_after_bytes=1)
    first.store.open("t", "c")
    for version in range(40):
        first.store.update("t", "c", version, [codec.diff("n", None, version)])
    redis, keys = redis_server.client(), keys_of("t", "c")
    assert redis.llen(keys.log) <= 2 and journal_file.decode(redis.get(keys.snap))["version"] >= 38
    assert first.shared.stats().folded >= 19
    assert same(node(tmp_path / "b", redis_server).store.get("t", "c"), first.store.get("t", "c"))
    first.journal.close()


@pytest.mark.parametrize("owner, context_id", [("a}", "b"), ("a", "}b"), ("a:b", "c"), ("a", "b:c"), ("%7D", "x")])
def test_no_tenant_or_id_ends_the_hash_tag_or_names_another_s_keys(owner, context_id):
    keys = keys_of(owner, context_id)
    tags = {key[key.index("{") + 1:key.index("}")] for key in keys}
    assert len(tags) == 1 and tags.pop().count(":") == 1   # one slot; the separator is the only colon
    others = [("a}", "b"), ("a", "}b"), ("a:b", "c"), ("a", "b:c"), ("%7D", "x"), ("}", "x"), ("a", "b")]
    assert sum(keys_of(*pair) == keys for pair in others) == 1


def test_a_node_behind_another_is_refused_then_restores_the_newer_copy(tmp_path, redis_server):
    first, second = node(tmp_path / "a", redis_server), node(tmp_path / "b", redis_server)
    first.store.open("t", "c")
    first.store.update("t", "c", 0, [codec.diff("n", None, 1)])
    assert second.store.get("t", "c").version == 1
    first.store.update("t", "c", 1, [codec.diff("n", None, 2)])
    with pytest.raises(MCPDError) as refused:
        second.store.update("t", "c", 1, [codec.diff("n", None, 99)])
    assert refused.value.code == codes.CONFLICT
    assert second.store.get("t", "c").fields["n"] == 2   # the newer copy, from Redis
    second.store.update("t", "c", 2, [codec.diff("n", None, 3)])
    assert node(tmp_path / "c", redis_server).store.get("t", "c").fields["n"] == 3
    first.journal.close()
    second.journal.close()


def test_redis_down_refuses_every_change_retryably_and_nothing_changes(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server)
    first.store.open("t", "c")
    first.store.update("t", "c", 0, [codec.diff("n", None, 1)])
    redis_server.kill()
    for change in (lambda: first.store.update("t", "c", 1, [codec.diff("n", None, 2)]),
                   lambda: first.store.open("t", "new"), lambda: first.store.drop("t", "c"),
                   lambda: first.store.get("t", "elsewhere")):
        with pytest.raises(MCPDError) as refused:
            change()
        assert refused.value.code == codes.UNAVAILABLE and refused.value.retry_after_ms > 0
    assert first.store.get("t", "c").fields["n"] == 1 and ("t", "new") not in first.store.contexts
    first.journal.close()
    on_disk = open_store(from_dict({"server": {"state_dir": str(tmp_path / "a")}}), None, LOG)
    assert on_disk.store.get("t", "c").version == 1 and ("t", "new") not in on_disk.store.contexts
    on_disk.journal.close()
    redis_server.start()
    first = node(tmp_path / "a", redis_server)
    first.store.update("t", "c", 1, [codec.diff("n", None, 2)])
    assert node(tmp_path / "b", redis_server).store.get("t", "c").fields["n"] == 2
    first.journal.close()


def test_an_evicting_redis_is_named_in_the_log(tmp_path, redis_server, caplog):
    node(tmp_path / "a", redis_server).journal.close()
    assert "maxmemory-policy" not in caplog.text   # the fixture's Redis runs with noeviction
    redis_server.client().config_set("maxmemory-policy", "allkeys-lru")
    node(tmp_path / "b", redis_server).journal.close()
    assert "maxmemory-policy allkeys-lru" in caplog.text


def test_on_the_journal_alone_changes_go_on_and_redis_catches_up_in_order(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server, when_redis_down="journal")
    first.store.open("t", "early")
    first.store.update("t", "early", 0, [codec.diff("n", None, 1)])
    first.store.open("t", "late")
    redis_server.kill()
    first.store.update("t", "late", 0, [codec.diff("n", None, 10)])   # acknowledged: in the journal
    first.store.update("t", "early", 1, [codec.diff("n", None, 2)])   # behind second, though first by name
    with pytest.raises(MCPDError) as unknown:   # a context this node lacks may be in Redis: not made anew
        first.store.open("t", "elsewhere")
    assert unknown.value.code == codes.UNAVAILABLE
    first.store.update("t", "early", 2, [codec.diff("n", None, 3)])
    with pytest.raises(MCPDError) as refused:   # a drop Redis missed would come back: still refused
        first.store.drop("t", "late")
    assert refused.value.code == codes.UNAVAILABLE
    first.shared.catch_up(0.0)   # Redis still down: nothing written, tried again later
    assert list(first.shared.behind) == [("t", "late"), ("t", "early")]   # the order they fell behind
    redis_server.start()
    early_meta = keys_of("t", "early").meta
    redis_server.client().delete(early_meta)
    redis_server.client().set(early_meta, "not a hash")   # early's write fails: the catch-up stops there
    first.shared.catch_up(first.shared.next_catch_up)
    assert list(first.shared.behind) == [("t", "early")]   # late, behind first, was written first
    redis_server.client().delete(early_meta)
    first.shared.catch_up(first.shared.next_catch_up)
    assert first.shared.behind == {}
    other = node(tmp_path / "b", redis_server)
    assert other.store.get("t", "early").fields["n"] == 3 and other.store.get("t", "late").fields["n"] == 10
    first.store.update("t", "early", 3, [codec.diff("n", None, 4)])   # straight to Redis again
    assert node(tmp_path / "c", redis_server).store.get("t", "early").version == 4
    first.journal.close()


def test_a_redis_behind_this_node_gets_the_whole_context_again(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server)
    first.store.open("t", "c")
    first.store.update("t", "c", 0, [codec.diff("n", None, 1)])
    redis_server.client().flushall()   # Redis lost what it held (say, restarted without its AOF)
    first.store.update("t", "c", 1, [codec.diff("n", None, 2)])
    restored = node(tmp_path / "b", redis_server).store.get("t", "c")
    assert restored.version == 2 and restored.fields["n"] == 2
    first.journal.close()


def test_a_drop_the_full_disk_refuses_leaves_the_context_in_redis_too(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server)
    made = grow(first.store)
    with files_capped_at(first.journal.size):   # Redis hears the drop first, then the journal refuses it
        with pytest.raises(MCPDError) as refused:
            first.store.drop("t", "c")
    assert refused.value.code == codes.STORAGE_FULL
    assert same(node(tmp_path / "b", redis_server).store.get("t", "c"), made)
    first.journal.close()


def test_a_context_over_this_node_s_limits_is_not_adopted(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server)
    first.store.open("t", "big")
    first.store.update("t", "big", 0, [codec.diff("w", None, np.zeros(4096, np.float32))])
    config = from_dict({"server": {"state_dir": str(tmp_path / "b")}, "contexts": {"max_total_bytes": 8192},
                        "cluster": {"redis": redis_server.url}})
    small = open_store(config, None, LOG)
    with pytest.raises(MCPDError) as refused:
        small.store.get("t", "big")
    assert refused.value.code == codes.TOO_LARGE and small.store.total_bytes == 0
    small.journal.close()
    first.journal.close()


def test_a_commit_the_journal_cannot_fsync_is_taken_back_from_redis(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server)
    first.store.open("t", "c")
    first.store.update("t", "c", 0, [codec.diff("n", None, 1)])
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, first.journal.fd)   # writes still succeed; fdatasync fails (EINVAL) while Redis takes the commit
    os.close(null)
    with pytest.raises(MCPDError) as refused:
        first.store.update("t", "c", 1, [codec.diff("n", None, 2)])
    assert refused.value.code == codes.UNAVAILABLE and refused.value.retry_after_ms > 0
    redis, keys = redis_server.client(), keys_of("t", "c")
    assert int(redis.hget(keys.meta, "version")) == 1 and redis.llen(keys.log) == 1
    assert first.store.get("t", "c").fields["n"] == 1
    first.store.update("t", "c", 1, [codec.diff("n", None, 3)])   # the journal wrote a snapshot since: on again
    restored = node(tmp_path / "b", redis_server).store.get("t", "c")
    assert restored.version == 2 and restored.fields["n"] == 3
    first.journal.close()
    on_disk = open_store(from_dict({"server": {"state_dir": str(tmp_path / "a")}}), None, LOG)
    assert on_disk.store.get("t", "c").version == 2 and on_disk.store.get("t", "c").fields["n"] == 3
    on_disk.journal.close()


def test_a_commit_the_full_disk_refuses_never_reaches_redis(tmp_path, redis_server):
    first = node(tmp_path / "a", redis_server)
    first.store.open("t", "c")
    first.store.update("t", "c", 0, [codec.diff("n", None, 1)])
    with files_capped_at(first.journal.size):   # the journal writes the record before Redis hears of it
        with pytest.raises(MCPDError) as refused:
            first.store.update("t", "c", 1, [codec.diff("n", None, 2)])
    assert refused.value.code == codes.STORAGE_FULL
    redis, keys = redis_server.client(), keys_of("t", "c")
    assert int(redis.hget(keys.meta, "version")) == 1 and redis.llen(keys.log) == 1
    first.store.update("t", "c", 1, [codec.diff("n", None, 3)])
    assert node(tmp_path / "b", redis_server).store.get("t", "c").fields["n"] == 3
    first.journal.close()

"""KV blocks in the shared device pool outlive the engine that computed them: a successor on the
same region adopts exactly the committed blocks, and resumes a chat with nothing recomputed that
an uninterrupted engine would not recompute but the rows of turn 1's partial last block (their
index lives in the engine's memory: partial_blocks.py), and the same tokens. In-process; the daemon test
with a real SIGKILL is in test_pool_keeper.py."""
import pytest

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine
from mcpd.engine.kv_records import NUM_BLOCKS_AT
from pool_keeping import DEVICES, KeptPool
from test_prefix_cache import GREEDY, SYSTEM, run_one

CONFIG = Config(model=ModelConfig(max_model_len=512), engine=EngineConfig(pool_bytes=16 << 20))


@pytest.fixture(params=DEVICES)
def pool(request, tmp_path):
    kept = KeptPool(tmp_path, request.param, 32 << 20)
    yield kept
    kept.close()


def test_a_successor_resumes_a_chat_from_the_committed_blocks(pool):
    first = Engine(CONFIG, pool.device, shared_pool=pool())
    turn1 = SYSTEM[:50]
    reply, _ = run_one(first, turn1)
    turn2 = turn1 + reply + [40, 41, 42]
    successor = Engine(CONFIG, pool.device, shared_pool=pool())   # the first engine is never used again
    assert successor.kv.adopted == len(first.kv.cached) == (len(turn1) + len(reply) - 1) // 16 > 0
    resumed, moved = run_one(successor, turn2)
    uninterrupted, expected = run_one(first, turn2)
    tail_rows = (len(turn1) + len(reply) - 1) % 16
    assert moved["prefix_cache_hits"] == (len(turn1) + len(reply) - 1) // 16 * 16
    assert expected["prefix_cache_hits"] == moved["prefix_cache_hits"] + tail_rows
    assert expected["tokens_prefilled"] == moved["tokens_prefilled"] - tail_rows
    assert resumed == uninterrupted
    assert successor.stats()["pool"].kv_blocks_adopted == successor.kv.adopted


def test_blocks_a_dying_engine_was_computing_are_never_adopted(pool):
    first = Engine(CONFIG, pool.device, shared_pool=pool())
    run_one(first, SYSTEM[:40])                    # 59 tokens computed: three full blocks, committed
    first.add_request("dying", SYSTEM[100:150], GREEDY)
    first.scheduler.schedule()                     # its blocks are cached and pending: the step never runs
    writing = [block for block in first.kv.pending]
    assert len(writing) == 3
    successor = Engine(CONFIG, pool.device, shared_pool=pool())
    assert successor.kv.adopted == 3 and not set(writing) & set(successor.kv.idle)
    assert sorted(successor.kv.cached.values()) == sorted(successor.kv.idle)


def test_an_evicted_block_is_retracted_before_its_bytes_change(pool):
    engine = Engine(CONFIG, pool.device, shared_pool=pool())
    run_one(engine, SYSTEM[:40])
    victim = next(block for block in engine.kv.idle if engine.kv.block_hashes[block] is not None)   # not the tail
    engine.kv.idle.pop(victim)
    engine.kv._evict(victim)
    assert engine.kv.records.committed[victim] == 0
    assert Engine(CONFIG, pool.device, shared_pool=pool()).kv.adopted == 2


def test_another_model_layout_gets_a_fresh_region(pool):
    run_one(Engine(CONFIG, pool.device, shared_pool=pool()), SYSTEM[:40])
    other = Config(model=ModelConfig(max_model_len=512), engine=EngineConfig(pool_bytes=16 << 20, kv_block_size=32))
    assert Engine(other, pool.device, shared_pool=pool()).kv.adopted == 0


def test_hostile_records_are_not_trusted(pool):
    engine = Engine(CONFIG, pool.device, shared_pool=pool())
    run_one(engine, SYSTEM[:40])
    records = engine.kv.records
    records.committed[records.zeroed + 5] = 1      # a block never handed out claims to be whole
    records.hashes[records.zeroed + 5] = ord("x")
    assert Engine(CONFIG, pool.device, shared_pool=pool()).kv.adopted == 3
    records.head[NUM_BLOCKS_AT] = 7                # a header that is not this region's
    assert Engine(CONFIG, pool.device, shared_pool=pool()).kv.adopted == 0

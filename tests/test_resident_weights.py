"""Weights in the shared device pool: the first engine loads them and keeps them in its weights
region; a successor on the same pool points its parameters there and reads no weight file, with
the same tokens. In-process; test_pool_keeper.py covers the daemon."""
import os

import pytest
import torch

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine
from mcpd.memory import pool_segment
from mcpd.memory.pool_segment import PoolSegment
from test_kv_survival import pool  # noqa: F401  (the fixture)
from test_prefix_cache import SYSTEM, run_one
from tiny_checkpoints import make_checkpoint

CPU = torch.device("cpu")


def config(path: str = "", quantization: str = "none") -> Config:
    return Config(model=ModelConfig(path=path, max_model_len=512, quantization=quantization),
                  engine=EngineConfig(pool_bytes=16 << 20))


def in_segment(engine: Engine, segment: PoolSegment) -> bool:
    start = torch.frombuffer(segment.mm, dtype=torch.uint8).data_ptr()
    return all(start <= p.data_ptr() < start + len(segment.mm) for p in engine.model.parameters() if p.numel())


def test_the_successor_takes_the_embedded_models_weights_from_the_pool(pool):  # noqa: F811
    first = Engine(config(), CPU, shared_pool=pool())
    tokens, _ = run_one(first, SYSTEM[:40])
    segment = pool()
    successor = Engine(config(), CPU, shared_pool=segment)
    assert not first.resident.from_pool and successor.resident.from_pool
    assert successor.stats()["pool"]["weights_from_pool"] and in_segment(successor, segment)
    assert run_one(successor, SYSTEM[:40])[0] == tokens


def test_a_checkpoints_successor_reads_no_weight_file(pool, tmp_path):  # noqa: F811
    path = make_checkpoint(tmp_path / "llama", "llama")
    first = Engine(config(str(path)), CPU, shared_pool=pool())
    tokens, _ = run_one(first, SYSTEM[:40])
    for weights in path.glob("*.safetensors"):   # garbage of the same size and time: the key holds
        st = os.stat(weights)
        weights.write_bytes(b"\xff" * st.st_size)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    successor = Engine(config(str(path)), CPU, shared_pool=pool())
    assert successor.resident.from_pool and run_one(successor, SYSTEM[:40])[0] == tokens


def test_int8_weights_are_kept_apart_from_the_float_ones_and_taken_from_the_pool(pool):  # noqa: F811
    """An int8 model's region (int8 values and their scales) is its own: a float engine's on the
    same pool is not taken for it, and its successor takes it with the same tokens."""
    Engine(config(), CPU, shared_pool=pool())
    first = Engine(config(quantization="int8"), CPU, shared_pool=pool())
    assert not first.resident.from_pool
    tokens, _ = run_one(first, SYSTEM[:40])
    segment = pool()
    successor = Engine(config(quantization="int8"), CPU, shared_pool=segment)
    assert successor.resident.from_pool and in_segment(successor, segment)
    assert run_one(successor, SYSTEM[:40])[0] == tokens


def test_weights_a_dying_engine_was_copying_are_loaded_again(pool):  # noqa: F811
    first = Engine(config(), CPU, shared_pool=pool())
    first.resident.head["complete"] = 0   # as if killed before the copy finished
    successor = Engine(config(), CPU, shared_pool=pool())
    assert not successor.resident.from_pool
    assert run_one(successor, SYSTEM[:40])[0] == run_one(Engine(config(), CPU), SYSTEM[:40])[0]


def test_a_pool_too_small_for_the_model_refuses_with_the_numbers(tmp_path):
    path, lock = pool_segment.segment_path(tmp_path, "cpu"), pool_segment.lock_path(tmp_path, "cpu")
    PoolSegment.create(path, lock, 4 << 20)
    try:
        with pytest.raises(pool_segment.PoolTooSmall, match=r"POOL_TOO_SMALL: worker 0 needs a weights region of "
                                                            r"\d+ bytes; the device pool has 4194304 of 4194304"):
            Engine(config(), CPU, shared_pool=PoolSegment(path, lock))
    finally:
        path.unlink()

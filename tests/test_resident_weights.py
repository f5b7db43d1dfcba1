"""Weights in the shared device pool: the first engine loads them and keeps them in its weights
region; a successor on the same pool points its parameters there and reads no weight file, with
the same tokens. In-process; test_pool_keeper.py covers the daemon."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine
from mcpd.engine.resident_weights import COMPLETE_AT
from mcpd.memory import pool_segment
from mcpd.memory.pool_segment import PoolSegment
from mcpd.kernels.forms import tensors_of
from mcpd.kernels.native_kernels import Packed
from mcpd.kernels.row_parts import RowParts
from test_kv_survival import pool  # noqa: F401  (the fixture)
from test_prefix_cache import SYSTEM, run_one
from tiny_checkpoints import make_checkpoint
from tiny_gguf import write_gguf

CPU = torch.device("cpu")


def config(path: str = "", kernels: str = "auto", huge_pages: bool = False, quantization: str = "none") -> Config:
    """huge_pages off: the model runs on the pool's bytes themselves, which these tests check
    (test_huge_pages.py covers the private copy onto 2 MiB pages)."""
    return Config(model=ModelConfig(path=path, max_model_len=512, quantization=quantization),
                  engine=EngineConfig(pool_bytes=16 << 20, kernels=kernels, huge_pages=huge_pages))


@pytest.fixture
def sized_pool(tmp_path):
    """sized_pool(nbytes): make a device pool of nbytes; returns a function mapping it anew."""
    path, lock = pool_segment.segment_path(tmp_path, "cpu"), pool_segment.lock_path(tmp_path, "cpu")

    def make(nbytes: int):
        PoolSegment.create(path, lock, nbytes)
        return lambda: PoolSegment(path, lock)
    yield make
    path.unlink(missing_ok=True)


def in_segment(engine: Engine, segment: PoolSegment) -> bool:
    """Every tensor the kernels read (packed panels included) lies in the segment, and no
    parameter holds bytes elsewhere."""
    start = torch.frombuffer(segment.mm, dtype=torch.uint8).data_ptr()
    forms = [engine.model.weights.embedding, engine.model.weights.head, engine.model.weights.final_norm]
    for layer in engine.model.weights.layers:
        forms += [layer.input_norm, layer.qkv, layer.o, layer.post_norm, layer.gate_up, layer.down]
    forms = [part for form in forms for part in (form.parts if isinstance(form, RowParts) else (form,))]
    tensors = [t for form in forms for t in tensors_of(form).values()]
    tensors += [p for p in engine.model.parameters() if p.numel()]
    return all(start <= t.data_ptr() < start + len(segment.mm) for t in tensors)


def test_the_successor_takes_the_embedded_models_weights_from_the_pool(pool):  # noqa: F811
    first = Engine(config(), CPU, shared_pool=pool())
    tokens, _ = run_one(first, SYSTEM[:40])
    segment = pool()
    successor = Engine(config(), CPU, shared_pool=segment)
    assert not first.resident.from_pool and successor.resident.from_pool
    assert successor.stats()["pool"].weights_from_pool and in_segment(successor, segment)
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


@pytest.mark.parametrize("path", ["", "llama"])
def test_the_native_kernels_packed_panels_are_the_pool_resident(pool, path, tmp_path):  # noqa: F811
    """The panels the kernels multiply live in the pool, nowhere else, and a successor runs on
    them as they are (nothing read, nothing packed)."""
    path = str(make_checkpoint(tmp_path / path, path)) if path else ""
    first_segment, segment = pool(), pool()
    first = Engine(config(path, "native"), CPU, shared_pool=first_segment)
    assert isinstance(first.model.weights.layers[0].qkv, Packed) and in_segment(first, first_segment)
    tokens, _ = run_one(first, SYSTEM[:40])
    successor = Engine(config(path, "native"), CPU, shared_pool=segment)
    assert successor.resident.from_pool and in_segment(successor, segment)
    assert run_one(successor, SYSTEM[:40])[0] == tokens == run_one(Engine(config(path, "native"), CPU), SYSTEM[:40])[0]


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_a_q4_k_m_files_matrices_in_parts_are_pool_resident_for_the_successor(pool, tmp_path, kernels):  # noqa: F811
    """A fused matrix held in parts of different forms (split_linear.py): each part's form lies
    in the pool, and the successor joins the parts it finds there."""
    path = str(write_gguf(tmp_path, "llama_wide", "Q4_K_M"))
    first_segment, segment = pool(), pool()
    first = Engine(config(path, kernels), CPU, shared_pool=first_segment)
    assert isinstance(first.model.weights.layers[0].qkv, RowParts) and in_segment(first, first_segment)
    tokens, _ = run_one(first, SYSTEM[:40])
    successor = Engine(config(path, kernels), CPU, shared_pool=segment)
    assert successor.resident.from_pool and in_segment(successor, segment)
    assert isinstance(successor.model.weights.layers[0].qkv, RowParts)
    assert run_one(successor, SYSTEM[:40])[0] == tokens


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
    first.resident.fields[COMPLETE_AT] = 0   # as if killed before the copy finished
    successor = Engine(config(), CPU, shared_pool=pool())
    assert not successor.resident.from_pool
    assert run_one(successor, SYSTEM[:40])[0] == run_one(Engine(config(), CPU), SYSTEM[:40])[0]


def test_a_record_holding_another_layout_is_reloaded_not_read(pool):  # noqa: F811
    first = Engine(config(kernels="native"), CPU, shared_pool=pool())
    first.resident.holds[:] = 1                    # complete, but says it holds something else
    assert first.resident.fields[COMPLETE_AT] == 1
    successor = Engine(config(kernels="native"), CPU, shared_pool=pool())
    assert successor.resident.reused and not successor.resident.from_pool
    assert successor.resident.holds_key()   # reloaded, and its record rewritten


def test_other_kernels_take_a_fresh_region_and_reload(sized_pool):
    """Weights kept in the torch kernels' form are never read as packed panels, nor the reverse."""
    pool = sized_pool(64 << 20)   # the old weights region and the new one, apart
    first = Engine(config(kernels="torch"), CPU, shared_pool=pool())
    tokens, _ = run_one(first, SYSTEM[:40])
    segment = pool()
    successor = Engine(config(kernels="native"), CPU, shared_pool=segment)
    assert not successor.resident.reused and not successor.resident.from_pool and in_segment(successor, segment)
    assert run_one(successor, SYSTEM[:40])[0] == tokens
    assert [r.kind for r in segment.stats().regions].count("weights") == 1   # the torch form's is freed


DYING_KEEP = """
import os, signal, sys, torch
from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine
from mcpd.memory.pool_segment import PoolSegment
from mcpd.kernels.forms import KernelForms

forms = KernelForms.kernel_forms
def dying(model, meta=False):   # SIGKILLed after copying some of the packed weights into the pool
    for i, form in enumerate(forms(model, meta)):
        if not meta and i == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        yield form
KernelForms.kernel_forms = dying
Engine(Config(model=ModelConfig(max_model_len=512), engine=EngineConfig(pool_bytes=16 << 20, kernels="native")),
       torch.device("cpu"), shared_pool=PoolSegment(sys.argv[1], sys.argv[2]))
"""


def test_weights_of_a_worker_killed_while_keeping_them_are_loaded_again(sized_pool, tmp_path):
    pool = sized_pool(32 << 20)
    where = [str(pool_segment.segment_path(tmp_path, "cpu")), str(pool_segment.lock_path(tmp_path, "cpu"))]
    dying = subprocess.run([sys.executable, "-c", DYING_KEEP, *where], capture_output=True)
    assert dying.returncode == -signal.SIGKILL, dying.stderr.decode()
    segment = pool()
    [row] = segment.stats().regions
    written = segment.buffer(pool_segment.Region(row.offset, row.bytes, True))
    # it died with bytes half written (torch's any: Python's iterates 32 MiB one scalar tensor at a time, 24 s)
    assert row.kind == "weights" and written[4096:].any()
    successor = Engine(config(kernels="native"), CPU, shared_pool=segment)
    assert successor.resident.reused and not successor.resident.from_pool
    assert run_one(successor, SYSTEM[:40])[0] == run_one(Engine(config(kernels="native"), CPU), SYSTEM[:40])[0]


def test_a_pool_too_small_for_the_model_refuses_with_the_numbers(tmp_path):
    path, lock = pool_segment.segment_path(tmp_path, "cpu"), pool_segment.lock_path(tmp_path, "cpu")
    PoolSegment.create(path, lock, 4 << 20)
    try:
        with pytest.raises(pool_segment.PoolTooSmall, match=r"POOL_TOO_SMALL: worker 0 needs a weights region of "
                                                            r"\d+ bytes; the device pool has 4194304 of 4194304"):
            Engine(config(), CPU, shared_pool=PoolSegment(path, lock))
    finally:
        path.unlink()

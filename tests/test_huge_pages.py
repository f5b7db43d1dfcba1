"""Private memory on 2 MiB pages (mcpd/memory/huge_pages.py), reading smaps for what pages a
tensor really got, and an engine running on its weights copied there (engine/weight_pages.py)."""
import mmap

import torch

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine
from mcpd.memory import huge_pages
from mcpd.kernels.forms import tensors_of
from test_kv_survival import pool  # noqa: F401  (the fixture)
from test_prefix_cache import SYSTEM, run_one

CPU = torch.device("cpu")

SMAPS = """\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:      2048 kB
ShmemPmdMapped:        0 kB
VmFlags: rd wr mr mw me ac hg
7f0000400000-7f0000600000 rw-s 00000000 00:1a 12    /dev/shm/pool
Size:               2048 kB
Rss:                1024 kB
AnonHugePages:         0 kB
ShmemPmdMapped:        0 kB
"""


def test_the_entry_holding_an_address_is_read_and_no_other():
    first = huge_pages._mapping_at(SMAPS, 0x7F0000001000)
    assert first["Rss"] == 4096 and first["AnonHugePages"] == 2048
    second = huge_pages._mapping_at(SMAPS, 0x7F0000400000)
    assert second["Rss"] == 1024 and second["AnonHugePages"] == 0
    assert huge_pages._mapping_at(SMAPS, 0x7F0000600000) is None


def test_an_arena_is_zeroed_whole_and_starts_on_a_huge_page_boundary():
    buffer = huge_pages.arena(5 << 20)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 6 << 20
    assert buffer.data_ptr() % huge_pages.HUGE == 0
    assert int(buffer.sum()) == 0
    buffer[-1] = 7   # writable to its last byte
    assert int(buffer.sum()) == 7


def test_memory_that_refuses_huge_pages_reads_as_none_of_them():
    memory = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    tensor[::4096] = 1
    assert huge_pages.huge_fraction(tensor) == 0.0


def test_an_arena_gets_huge_pages_where_the_kernel_gives_them_on_request():
    try:
        setting = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:   # a kernel without transparent huge pages
        setting = "[never]"
    buffer = huge_pages.arena(16 << 20)
    if "[never]" in setting:
        assert huge_pages.huge_fraction(buffer) == 0.0
    else:   # "always" or "madvise": the arena asked, at fault time (defrag permitting)
        assert huge_pages.huge_fraction(buffer) > 0.0


def host_gives_huge_pages() -> bool:
    return huge_pages.huge_fraction(huge_pages.arena(4 << 20)) >= 0.5


def engine_config(huge: bool) -> Config:
    return Config(model=ModelConfig(max_model_len=512),
                  engine=EngineConfig(pool_bytes=16 << 20, kernels="auto", huge_pages=huge))


def weight_tensors(engine: Engine) -> list[torch.Tensor]:
    return [t for form in engine.model.forms.values() for t in tensors_of(form).values()]


def test_an_engine_runs_on_its_weights_copied_onto_huge_pages_with_the_same_tokens():
    on, off = Engine(engine_config(True), CPU), Engine(engine_config(False), CPU)
    biggest = max(weight_tensors(on), key=torch.Tensor.numel)
    if host_gives_huge_pages():   # copied there, or (smaps counts a whole mapping) found there already
        assert on.pages_reason.startswith(("weights copied onto 2 MiB pages", "weights on 2 MiB pages"))
        assert huge_pages.huge_fraction(biggest) >= 0.5
    else:
        assert on.pages_reason.startswith("weights on 4 KiB pages")
    assert "engine.huge_pages = false" in off.pages_reason
    assert run_one(on, SYSTEM[:40])[0] == run_one(off, SYSTEM[:40])[0]


def test_on_the_shared_pool_the_pool_keeps_its_copy_for_a_successor(pool):  # noqa: F811
    first = Engine(engine_config(True), CPU, shared_pool=pool())
    tokens, _ = run_one(first, SYSTEM[:40])
    pool_start = torch.frombuffer(first.shared_pool.mm, dtype=torch.uint8).data_ptr()
    in_pool = [pool_start <= t.data_ptr() < pool_start + len(first.shared_pool.mm) for t in weight_tensors(first)]
    assert not any(in_pool) if host_gives_huge_pages() else all(in_pool)
    successor = Engine(engine_config(True), CPU, shared_pool=pool())
    assert successor.resident.from_pool   # the pool's copy was complete, and is read, not the checkpoint
    assert run_one(successor, SYSTEM[:40])[0] == tokens

"""Private memory on 2 MiB pages (mcpd/memory/huge_pages.py), and reading smaps for what pages
a tensor really got."""
import mmap

import torch

from mcpd.memory import huge_pages

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

"""A CPU step of decodes' arrays from the kept buffer (mcpd/models/decode_arrays.py) are those
AttentionMetadata.build makes, step after step, as the batch's size and table width change."""
import random

import torch

from mcpd.models.decode_arrays import DecodeArrays
from mcpd.models.layers import AttentionMetadata

CPU = torch.device("cpu")


def _same(mine: AttentionMetadata, expected: AttentionMetadata) -> bool:
    (group,), (expected_group,) = mine.groups, expected.groups
    return (all(torch.equal(getattr(mine, name), getattr(expected, name))
                for name in ("positions", "slot_blocks", "slot_offsets"))
            and mine.num_positions == expected.num_positions and group.decoding and expected_group.decoding
            and (group.start, group.end) == (expected_group.start, expected_group.end)
            and torch.equal(group.block_table, expected_group.block_table)
            and torch.equal(group.context_lens, expected_group.context_lens))


def test_each_step_equals_build_as_the_batch_changes_shape():
    rng, arrays, block_size = random.Random(0), DecodeArrays(), 4
    # batch sizes rise (the buffer grows), repeat (views reused) and fall; contexts cross blocks
    for sequences in (1, 1, 1, 3, 3, 8, 2, 2, 1, 16):
        starts = [rng.randrange(0, 40) for _ in range(sequences)]
        tables = [rng.sample(range(100), s // block_size + 1 + rng.randrange(3)) for s in starts]
        ids = [rng.randrange(320) for _ in range(sequences)]
        got_ids, got = arrays.build(ids, tables, starts, block_size)
        assert got_ids.tolist() == ids
        assert _same(got, AttentionMetadata.build(tables, starts, [1] * sequences, block_size, CPU))


def test_a_step_overwrites_the_last_ones_views_in_place():
    """What the engine relies on, and why it is CPU only: one buffer, rewritten each step."""
    arrays = DecodeArrays()
    first_ids, first = arrays.build([5], [[7, 8]], [4], 4)
    second_ids, second = arrays.build([6], [[9, 3]], [5], 4)
    assert first_ids.data_ptr() == second_ids.data_ptr() and first_ids.tolist() == [6]
    assert first.slot_blocks.tolist() == [3] and second.positions.tolist() == [5]

"""The one percentile (mcpd/percentile.py): nearest rank, always an observed value."""
import pytest

from mcpd.percentile import percentile


def test_nearest_rank_over_a_hundred():
    samples = list(range(100, 0, -1))   # order does not matter
    assert percentile(samples, 0.99) == 99 and percentile(samples, 0.5) == 50
    assert percentile(samples, 1.0) == 100 and percentile(samples, 0.001) == 1


def test_small_counts():
    assert percentile([7.0], 0.99) == 7.0 and percentile([7.0], 0.0) == 7.0
    assert percentile([1, 2], 0.5) == 1 and percentile([1, 2], 0.51) == 2
    with pytest.raises(ValueError):
        percentile([], 0.5)

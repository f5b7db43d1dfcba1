"""The dynamic batcher in-process, with a clock passed in: when a batch goes out (full, a preferred
size, cannot grow, the oldest's delay run out), in which order (rank, then age), which requests
share one (length bins, rows never split). Assembling a batch's tensors is test_batch_tensors.py's."""
import pytest

from mcpd.handlers.batcher import DynamicBatcher, Pending
from mcpd.handlers.predict_cost import PredictCost


def pending(key, rows=1, length=0, rank=0, arrived=0.0, item=None):
    return Pending(key, rows, length, rank, arrived, item)


def keys(batch):
    return [p.key for p in batch] if batch is not None else None


def test_a_full_batch_goes_at_once_and_the_rest_waits_for_the_delay():
    batcher = DynamicBatcher(max_batch_size=4, max_queue_delay_ms=10)
    for key in range(6):
        batcher.add(pending(key, arrived=0.0))
    assert keys(batcher.next_batch(0.0)) == [0, 1, 2, 3]
    assert batcher.next_batch(0.0099) is None
    assert batcher.due() == pytest.approx(0.010)
    assert keys(batcher.next_batch(0.010)) == [4, 5]
    assert batcher.next_batch(1.0) is None and batcher.due() is None and len(batcher) == 0


def test_full_only_takes_a_full_batch_or_a_request_too_large_for_one_and_leaves_a_ready_partial_one():
    batcher = DynamicBatcher(max_batch_size=4, max_queue_delay_ms=10)
    batcher.add(pending(0, rows=3, arrived=0.0))
    assert batcher.next_batch(1.0, full_only=True) is None and len(batcher) == 1   # ready, not full
    batcher.add(pending(1, rows=1, arrived=0.0))
    assert keys(batcher.next_batch(0.0, full_only=True)) == [0, 1]
    batcher.add(pending(2, rows=9, arrived=0.0))
    assert keys(batcher.next_batch(0.0, full_only=True)) == [2]


def test_the_delay_counts_from_the_oldest_request():
    batcher = DynamicBatcher(max_batch_size=8, max_queue_delay_ms=2)
    batcher.add(pending(1, arrived=1.000))
    batcher.add(pending(2, arrived=1.0015))
    assert batcher.due() == pytest.approx(1.002)
    assert batcher.next_batch(1.0019) is None
    assert keys(batcher.next_batch(1.002)) == [1, 2]


def test_a_preferred_size_goes_without_waiting_for_the_delay():
    batcher = DynamicBatcher(max_batch_size=64, max_queue_delay_ms=1000, preferred_batch_sizes=[4])
    for key in range(3):
        batcher.add(pending(key))
    assert batcher.next_batch(0.0) is None
    batcher.add(pending(3))
    assert keys(batcher.next_batch(0.0)) == [0, 1, 2, 3]


def test_the_largest_preferred_size_the_waiting_requests_reach_goes():
    batcher = DynamicBatcher(max_batch_size=64, max_queue_delay_ms=1000, preferred_batch_sizes=[2, 4, 8])
    for key in range(5):
        batcher.add(pending(key))
    assert keys(batcher.next_batch(0.0)) == [0, 1, 2, 3]
    assert batcher.next_batch(0.0) is None and len(batcher) == 1


def test_a_preferred_size_counts_rows_not_requests():
    batcher = DynamicBatcher(max_batch_size=64, max_queue_delay_ms=1000, preferred_batch_sizes=[6])
    batcher.add(pending(1, rows=2))
    batcher.add(pending(2, rows=3))
    assert batcher.next_batch(0.0) is None
    batcher.add(pending(3, rows=1))
    assert keys(batcher.next_batch(0.0)) == [1, 2, 3]


def test_higher_rank_goes_first_then_the_older():
    batcher = DynamicBatcher(max_batch_size=2, max_queue_delay_ms=0)
    batcher.add(pending(1, rank=0, arrived=0.0))
    batcher.add(pending(2, rank=0, arrived=0.1))
    batcher.add(pending(3, rank=5, arrived=0.2))
    batcher.add(pending(4, rank=5, arrived=0.3))
    assert keys(batcher.next_batch(1.0)) == [3, 4]
    assert keys(batcher.next_batch(1.0)) == [1, 2]


def test_between_length_bins_the_group_whose_head_ranks_highest_goes_first():
    batcher = DynamicBatcher(max_batch_size=4, max_queue_delay_ms=0, length_bins=[16, 64])
    batcher.add(pending(1, length=10, rank=0, arrived=0.0))
    batcher.add(pending(2, length=50, rank=3, arrived=0.5))
    assert keys(batcher.next_batch(1.0)) == [2]
    assert keys(batcher.next_batch(1.0)) == [1]


def test_requests_of_different_length_bins_share_no_batch_while_the_predicts_cost_is_unknown():
    batcher = DynamicBatcher(max_batch_size=8, max_queue_delay_ms=5, length_bins=[16, 32])
    batcher.add(pending(1, length=10, arrived=0.0))
    batcher.add(pending(2, length=30, arrived=0.0))
    batcher.add(pending(3, length=12, rows=2, arrived=0.0))
    batcher.add(pending(4, length=500, arrived=0.0))   # past the largest bin: a group of its own
    batches = sorted(keys(batcher.next_batch(0.005)) for _ in range(3))
    assert batches == [[1, 3], [2], [4]]


def test_a_request_that_would_not_fit_leaves_the_batch_full_enough_to_go():
    batcher = DynamicBatcher(max_batch_size=4, max_queue_delay_ms=1000)
    batcher.add(pending(1, rows=3))
    assert batcher.next_batch(0.0) is None
    batcher.add(pending(2, rows=3))
    assert keys(batcher.next_batch(0.0)) == [1]   # 6 rows would pass 4: 1 goes alone, unsplit
    assert batcher.next_batch(0.0) is None and keys(batcher.next_batch(1.0)) == [2]


def test_a_request_with_more_rows_than_the_largest_batch_runs_alone_at_once():
    batcher = DynamicBatcher(max_batch_size=4, max_queue_delay_ms=1000)
    batcher.add(pending(1, rows=10))
    batcher.add(pending(2, rows=1))
    assert keys(batcher.next_batch(0.0)) == [1]
    assert batcher.next_batch(0.0) is None


def test_max_batch_size_zero_runs_each_request_alone_at_once_in_rank_order():
    batcher = DynamicBatcher(max_batch_size=0, max_queue_delay_ms=1000)
    batcher.add(pending(1, rank=0))
    batcher.add(pending(2, rank=1))
    assert keys(batcher.next_batch(0.0)) == [2]
    assert keys(batcher.next_batch(0.0)) == [1]


def test_a_cancelled_request_leaves_the_queue():
    batcher = DynamicBatcher(max_batch_size=2, max_queue_delay_ms=0, length_bins=[8])
    batcher.add(pending(1, length=3))
    batcher.add(pending(2, length=3))
    assert batcher.remove(1).key == 1
    assert batcher.remove(1) is None and batcher.remove(99) is None
    assert keys(batcher.next_batch(0.0)) == [2]
    batcher.add(pending(3))
    with pytest.raises(ValueError, match="already waiting"):
        batcher.add(pending(3))



def test_a_request_of_an_urgent_rank_goes_at_once_with_those_waiting_and_a_lesser_one_waits():
    batcher = DynamicBatcher(max_batch_size=8, max_queue_delay_ms=10, urgent_rank=2)
    batcher.add(pending(1, rank=1, arrived=0.0))
    assert batcher.next_batch(0.001) is None and batcher.due() == pytest.approx(0.010)
    batcher.add(pending(2, rank=2, arrived=0.002))
    assert batcher.due() == pytest.approx(0.002)
    assert keys(batcher.next_batch(0.002)) == [2, 1]   # the urgent one first, the waiting one with it


def measured(fixed_s: float, per_element_s: float) -> PredictCost:
    """A cost learned from predicts that took exactly fixed_s + per_element_s a padded element."""
    cost = PredictCost()
    for elements in (8, 64, 512):
        cost.observe(elements, fixed_s + per_element_s * elements)
    return cost


def arrivals(batcher: DynamicBatcher, gap_s: float, count: int) -> float:
    """`count` requests `gap_s` apart, each answered at once (only the arrival rate stays); when
    the next one is due."""
    for at in range(count):
        batcher.add(pending(1000 + at, arrived=at * gap_s))
        batcher.remove(1000 + at)
    return count * gap_s


def test_the_cost_of_a_predict_is_learned_as_a_fixed_part_and_a_part_per_padded_element():
    cost = measured(fixed_s=0.002, per_element_s=1e-5)
    assert cost.known
    assert cost.fixed_s == pytest.approx(0.002) and cost.per_element_s == pytest.approx(1e-5)
    assert cost.padding_pays(190) and not cost.padding_pays(210)   # 200 elements cost what a predict's fixed part does


def test_predicts_all_of_one_size_leave_the_cost_unknown_and_no_padding_pays():
    cost = PredictCost()
    for _ in range(10):
        cost.observe(64, 0.003)
    assert not cost.known and not cost.padding_pays(0)


def test_a_batch_waits_only_while_the_rows_due_within_a_predicts_fixed_cost_outnumber_its_own():
    slow = DynamicBatcher(max_batch_size=8, max_queue_delay_ms=10, cost=measured(0.001, 1e-6))
    now = arrivals(slow, gap_s=0.005, count=40)   # 0.2 requests per fixed cost: waiting would not pay
    slow.add(pending(1, arrived=now))
    assert slow.due() == pytest.approx(now)
    assert keys(slow.next_batch(now)) == [1]

    busy = DynamicBatcher(max_batch_size=8, max_queue_delay_ms=10, cost=measured(0.001, 1e-6))
    now = arrivals(busy, gap_s=0.0002, count=40)   # 5 requests per fixed cost: one waiting waits for them
    busy.add(pending(1, arrived=now))
    assert busy.due() == pytest.approx(now + 0.010)
    assert busy.next_batch(now) is None and keys(busy.next_batch(now + 0.010)) == [1]


def test_length_bins_share_a_batch_only_when_the_padding_costs_less_than_the_predict_it_saves():
    def batches(cost):
        batcher = DynamicBatcher(max_batch_size=8, max_queue_delay_ms=5, length_bins=[16, 32, 128], cost=cost)
        batcher.add(pending(1, length=30, arrived=0.0))
        batcher.add(pending(2, length=10, rows=2, arrived=0.001))
        batcher.add(pending(3, length=100, arrived=0.002))
        found = []
        while len(batcher):
            found.append(keys(batcher.next_batch(1.0)))
        return found

    # 2 rows padded 10 -> 30: 40 elements; a row of 100 pads the three others by 170 + 70
    assert batches(measured(fixed_s=0.001, per_element_s=1e-5)) == [[1, 2], [3]]
    assert batches(measured(fixed_s=0.001, per_element_s=1e-6)) == [[1, 2, 3]]
    assert batches(measured(fixed_s=0.001, per_element_s=1e-4)) == [[1], [2], [3]]
    assert batches(PredictCost()) == [[1], [2], [3]]   # not measured yet: bins stay apart


def test_a_group_that_does_not_fit_the_batchs_rows_stays_for_a_batch_of_its_own():
    batcher = DynamicBatcher(max_batch_size=4, max_queue_delay_ms=5, length_bins=[16, 32],
                             cost=measured(fixed_s=0.001, per_element_s=1e-7))
    batcher.add(pending(1, length=30, rows=2, arrived=0.0))
    batcher.add(pending(2, length=10, rows=3, arrived=0.001))
    assert keys(batcher.next_batch(1.0)) == [1]
    assert keys(batcher.next_batch(1.0)) == [2]

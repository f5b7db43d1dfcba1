"""The handlers' result cache in-process: isolation (tenant, model, version, the inputs' every
header field), its byte bound, frequency-aware admission against one-off floods, the sketch's
fading, warm-up files, and its hit rate on a Zipf(1.1) stream against plain LRU."""
from collections import OrderedDict

import numpy as np
import pytest

from mcpd.handlers.frequency_sketch import MAX_COUNT, FrequencySketch
from mcpd.handlers.result_cache import CachedResult, ResultCache, _cost, cache_key
from mcpd.handlers.result_cache_stats import ResultCacheStats
from mcpd.handlers.tensors import TensorHeader
from mcpd.handlers.warmup_file import WarmInput, read_warmup, write_warmup

X = (TensorHeader("x", "INT64", (1, 1)),)
RESULT = CachedResult((TensorHeader("y", "FP32", (1, 1)),), (bytes(4),))


def key(n: int, tenant="t", model="m", version="v"):
    return cache_key(tenant, model, version, X, (n.to_bytes(8, "little"),))


ENTRY = _cost(key(0), RESULT)   # every entry here costs the same


def test_a_result_is_served_again_for_the_same_inputs_and_counted():
    cache = ResultCache(100 * ENTRY)
    assert cache.get(key(1)) is None
    assert cache.put(key(1), RESULT)
    assert cache.get(key(1)) == RESULT
    stats = cache.stats()
    assert stats == ResultCacheStats(1, stats.bytes, 100 * ENTRY, hits=1, misses=1, evictions=0, refused=0, hit_rate=0.5)


@pytest.mark.parametrize("other", [key(1, tenant="u"), key(1, version="v2"), key(1, model="m2"), key(2)])
def test_another_tenant_version_model_or_input_never_gets_the_result(other):
    cache = ResultCache(100 * ENTRY)
    cache.put(key(1), RESULT)
    assert cache.get(other) is None


@pytest.mark.parametrize("headers, frames", [
    ((TensorHeader("x", "INT64", (2, 1)),), (bytes(16),)),       # the same bytes, another shape
    ((TensorHeader("x", "FP64", (1, 2)),), (bytes(16),)),        # another datatype
    ((TensorHeader("z", "INT64", (1, 2)),), (bytes(16),)),       # another name
    ((TensorHeader("x", "INT64", (1, 1)), TensorHeader("w", "INT64", (1, 1))), (bytes(4), bytes(12))),
])
def test_the_key_covers_every_header_field_and_where_each_frame_ends(headers, frames):
    reference = cache_key("t", "m", "v", (TensorHeader("x", "INT64", (1, 2)),), (bytes(16),))
    assert cache_key("t", "m", "v", headers, frames) != reference
    split_differently = cache_key("t", "m", "v", (TensorHeader("x", "INT64", (1, 1)), TensorHeader("w", "INT64", (1, 1))),
                                  (bytes(8), bytes(8)))
    assert cache_key("t", "m", "v", headers, frames) != split_differently


def test_the_cache_never_holds_more_bytes_than_its_bound():
    cache = ResultCache(10 * ENTRY + ENTRY // 2)
    for n in range(200):
        for _ in range(n % 3 + 1):
            cache.get(key(n))
        cache.put(key(n), RESULT)
        assert cache.stats().bytes <= cache.max_bytes
    assert len(cache) == 10 and cache.stats().evictions > 0
    huge = CachedResult(RESULT.headers, (bytes(11 * ENTRY),))
    assert not cache.put(key(999), huge)


def test_a_one_off_input_does_not_evict_a_popular_result():
    cache = ResultCache(2 * ENTRY)
    for n in (1, 2):
        for _ in range(3):
            cache.get(key(n))
        cache.put(key(n), RESULT)
    cache.get(key(3))
    assert not cache.put(key(3), RESULT)
    assert cache.get(key(1)) and cache.get(key(2)) and cache.stats().refused == 1


def test_an_input_asked_for_more_often_than_the_victim_takes_its_place():
    cache = ResultCache(2 * ENTRY)
    for n in (1, 2):
        cache.get(key(n))
        cache.put(key(n), RESULT)
    for _ in range(3):
        cache.get(key(3))
    assert cache.put(key(3), RESULT)
    assert cache.stats().evictions == 1 and cache.get(key(3)) == RESULT
    assert cache.get(key(1)) is None   # the least recent on probation went


def test_the_sketch_counts_saturate_and_halve_so_old_popularity_fades():
    sketch = FrequencySketch(10)   # halves every 100 additions
    hot = key(1)[3]
    for _ in range(20):
        sketch.add(hot)
    assert sketch.estimate(hot) == MAX_COUNT
    for n in range(2, 2 + sketch.sample_size - 20):
        sketch.add(key(n)[3])
    assert sketch.estimate(hot) == MAX_COUNT // 2


def test_warm_entries_are_cached_and_a_warmup_file_round_trips(tmp_path):
    path = str(tmp_path / "warm.msgpack")
    requests = [WarmInput("t", X, (n.to_bytes(8, "little"),)) for n in range(3)] + [WarmInput("u", X, (bytes(8),))]
    write_warmup(path, requests)
    assert read_warmup(path) == requests
    cache = ResultCache(100 * ENTRY)
    assert cache.warm((cache_key(r.tenant, "m", "v", r.headers, r.frames), RESULT) for r in requests) == 4
    assert cache.get(key(2)) == RESULT and cache.get(key(0, tenant="u")) == RESULT


@pytest.mark.parametrize("content, says", [
    (b"\x91\x81\xa6inputs\x90", "payload"),                             # [{"inputs": []}]: no payload
    (b"\x91\x82\xa6inputs\x91\x83\xa4name\xa1x\xa8datatype\xa4BF16\xa5shape\x91\x01\xa7payload\x91\xc4\x02ab",
     "entry 0: input 'x': datatype 'BF16'"),
    (b"\x91\x82\xa6inputs\x90\xa7payload\x91\xc4\x00", "entry 0: 0 inputs but 1 payload frames"),
    (b"\xc1", "cache warmup file"),
])
def test_a_damaged_warmup_file_is_refused_naming_what_is_wrong(tmp_path, content, says):
    path = tmp_path / "warm.msgpack"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=says):
        read_warmup(str(path))


def test_a_warmup_file_past_its_bound_is_not_read(tmp_path):
    path = tmp_path / "warm.msgpack"
    path.write_bytes(bytes(100))
    with pytest.raises(ValueError, match="100 bytes, more than the 99 it may hold"):
        read_warmup(str(path), max_bytes=99)


KEYS = 100_000
CAPACITY = 20_000     # entries: a fifth of the keys
WARMUP, MEASURED = 300_000, 300_000


def zipf_stream() -> np.ndarray:
    weights = 1.0 / np.arange(1, KEYS + 1) ** 1.1
    return np.random.default_rng(0).choice(KEYS, size=WARMUP + MEASURED, p=weights / weights.sum())


def lru_hit_rate(stream) -> float:
    held, hits = OrderedDict(), 0
    for at, n in enumerate(stream):
        if n in held:
            held.move_to_end(n)
            hits += at >= WARMUP
        else:
            held[n] = True
            if len(held) > CAPACITY:
                held.popitem(last=False)
    return hits / MEASURED


def test_on_a_zipf_stream_the_admission_reaches_ninety_percent_where_plain_lru_does_not():
    """Zipf(1.1) over 100k inputs: the 12,144 most asked-for hold 90% of the requests, so no cache
    reaches 0.9 with fewer entries; knowing only what it has seen, this one does with 20,000
    (after 300k requests of warm-up), and plain LRU of the same size does not."""
    stream = zipf_stream()
    keys = [key(int(n)) for n in range(KEYS)]
    cache = ResultCache(CAPACITY * ENTRY)
    hits = 0
    for at, n in enumerate(stream):
        if cache.get(keys[n]) is None:
            cache.put(keys[n], RESULT)
        else:
            hits += at >= WARMUP
    admission, lru = hits / MEASURED, lru_hit_rate(stream)
    assert len(cache) == CAPACITY
    assert admission >= 0.9 > lru, (admission, lru)


def test_a_flood_of_one_off_inputs_does_not_wash_the_popular_results_out():
    """Every other request an input never seen again (a scan, random inputs): on the Zipf half,
    the admission keeps 0.866 (0.842 without it, a segmented LRU alone) where plain LRU falls to 0.785."""
    stream = zipf_stream()
    one_off = np.arange(len(stream)) % 2 == 1
    stream[one_off] = KEYS + np.arange(one_off.sum())
    cache, hits = ResultCache(CAPACITY * ENTRY), 0
    for at, n in enumerate(stream):
        k = key(int(n))
        if cache.get(k) is None:
            cache.put(k, RESULT)
        else:
            hits += at >= WARMUP
    admission, lru = hits / (MEASURED / 2), lru_hit_rate(stream) * 2
    assert admission >= 0.85 and lru < 0.8, (admission, lru)

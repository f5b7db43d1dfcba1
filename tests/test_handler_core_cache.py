"""The handler worker's result cache in-process: a hit is answered at dispatch and never reaches
the batcher nor predict; a warm-up file's good entries are cached at start and the ones the model
refuses are skipped; a failed predict caches nothing."""
import logging

import numpy as np

import faulty_handlers
from fakes import Clock, Ports
from mcpd.config import Config, VersionConfig
from mcpd.config.handlers import BatchingConfig, ResultCacheConfig
from mcpd.daemon.worker.handler_core import HandlerCore
from mcpd.handlers import tensors
from mcpd.handlers.tensor_header import TensorHeader
from mcpd.handlers.warmup_file import WarmInput, write_warmup
from test_handler_core import RULES, expected, features, finals, run_until_idle, scores, send


def make_core(warmup: str = "") -> HandlerCore:
    version = VersionConfig(handler=RULES, batching=BatchingConfig(max_batch_size=4, max_queue_delay_ms=10.0),
                            cache=ResultCacheConfig(max_bytes=1 << 20, warmup=warmup))
    handler = faulty_handlers.Faulty()
    handler.setup("cpu", {})
    return HandlerCore(Config(model=version), 0, handler, "cpu", logging.getLogger("test"), Ports(), Clock(),
                       serves=("risk", "v1"))


def test_a_hit_is_answered_at_dispatch_without_the_batcher_or_predict():
    core, x = make_core(), features(2, seed=1)
    send(core, 1, {"features": x})
    run_until_idle(core)
    batches = core.batches
    send(core, 2, {"features": x})
    assert not core.has_work and core.batches == batches   # nothing waits, nothing ran
    replies = finals(core)
    assert replies[2][0]["result"]["cached"] and not replies[1][0]["result"]["cached"]
    np.testing.assert_array_equal(scores(replies[2]), scores(replies[1]))
    assert core.stats().result_cache.hits == 1


def test_a_failed_predict_caches_nothing():
    core, x = make_core(), features(1, seed=2, trigger=faulty_handlers.RAISE)
    for rid in (1, 2):
        send(core, rid, {"features": x})
        run_until_idle(core)
    assert {rid: reply[0]["code"] for rid, reply in finals(core).items()} == {1: "INTERNAL", 2: "INTERNAL"}
    assert core.stats().result_cache.entries == 0


def test_warmup_caches_the_good_entries_and_skips_those_the_model_refuses(tmp_path, caplog):
    good = features(3, seed=3)
    header, frame = tensors.encode("features", good)
    path = str(tmp_path / "warm.msgpack")
    write_warmup(path, [
        WarmInput("t", (TensorHeader("nope", "FP32", (1, 256)),), (bytes(1024),)),   # an input the model lacks
        WarmInput("t", (header,), (frame[:-4],)),                                        # a byte short
        WarmInput("t", (header,), (frame,)),
        WarmInput("t", *zip(tensors.encode("features", features(1, seed=4, trigger=faulty_handlers.RAISE)))),
    ])
    with caplog.at_level(logging.INFO):
        core = make_core(path)
    assert core.stats().result_cache.entries == 1   # the good one, run again alone after its batch failed
    assert "1 of 4 requests cached; 3 skipped, the first: entry 0: BAD_INPUT" in caplog.text
    send(core, 1, {"features": good})
    assert not core.has_work
    reply = finals(core)[1]
    assert reply[0]["result"]["cached"]
    np.testing.assert_allclose(scores(reply), expected(good), rtol=1e-6)

"""Every number in the configuration has a declared range (mcpd/config_bounds.py): a value just
outside it is refused as the file is read, naming the key, the value and the range; one just
inside is taken. And mcpd itself, handed such a file, exits 2 saying so."""
import dataclasses
import math
import subprocess
import typing

import pytest

from mcpd import refusal
from mcpd.config import Config, ConfigError, from_dict
from mcpd.config_bounds import bound_of
from mcpd.testing import BIN

SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
CLASS = "scheduler.classes.normal"         # the one class: it must be the default class
TENANT = "scheduler.tenants.batch"
VERSION = "models.risk.versions.v1"        # a handler version, the model's only one
BYTES, TOKENS, COUNT = 1 << 48, 1 << 24, 1 << 20


def up(x: float) -> float:
    return math.nextafter(x, math.inf)


def down(x: float) -> float:
    return math.nextafter(x, -math.inf)


def at(key: str, value, also: dict) -> dict:
    """The raw config holding key = value (dotted keys) beside the keys of `also`."""
    raw: dict = {}
    for dotted, v in {key: value, **also}.items():
        *tables, last = dotted.split(".")
        table = raw
        for name in tables:
            table = table.setdefault(name, {})
        table[last] = v
    return raw


def read(config: Config, key: str):
    value = config
    for name in key.split("."):
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    return value


# (key, just inside, just outside, the range as the refusal states it, keys the inside value needs)
CASES = [
    ("limits.max_message_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("limits.max_header_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {"limits.max_message_bytes": BYTES}),
    ("limits.max_frames", 1024, 1025, "in [1, 1024]", {}),
    ("limits.max_prompt_tokens", TOKENS, TOKENS + 1, "in [1, 16777216]", {}),
    ("limits.max_new_tokens", TOKENS, TOKENS + 1, "in [1, 16777216]", {}),
    ("limits.max_stream_chunks_per_s", 1e6, up(1e6), "in [0.1, 1000000]", {}),
    ("limits.max_stream_chunks_per_s", 0.1, down(0.1), "in [0.1, 1000000]", {}),   # 1/rate: a chunk in ages
    ("limits.max_client_backlog_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("limits.max_incoming_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("limits.max_connections_per_address", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("limits.max_tensor_elements", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("scheduler.max_queue", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("scheduler.max_inflight", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("scheduler.max_inflight_per_worker", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("scheduler.overloaded_retry_ms", 3_600_000, 3_600_001, "in [0, 3600000]", {}),
    ("scheduler.window_target_p99_ms", 60_000.0, up(60_000.0), "in [0, 60000]", {}),
    ("scheduler.window_min_ms", 10_000.0, up(10_000.0), "in [0, 10000]", {"scheduler.window_max_ms": 10_000.0}),
    ("scheduler.window_max_ms", 10_000.0, up(10_000.0), "in [0, 10000]", {}),
    ("scheduler.degrade_queue_depth", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("scheduler.degrade_after_s", 3600.0, up(3600.0), "in [0, 3600]", {}),
    ("scheduler.shed_wait_ms", 60_000.0, up(60_000.0), "in [0, 60000]", {}),
    ("scheduler.shed_in_flight", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("scheduler.tenant_headroom", COUNT, COUNT + 1, "in [0, 1048576]", {}),
    (f"{CLASS}.rank", 1000, 1001, "in [-1000, 1000]", {}),
    (f"{CLASS}.rank", -1000, -1001, "in [-1000, 1000]", {}),
    (f"{CLASS}.max_queue", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    (f"{CLASS}.max_age_s", 3600.0, up(3600.0), "0 (off) or in [0.001, 3600]", {}),
    (f"{CLASS}.max_age_s", 0.001, down(0.001), "0 (off) or in [0.001, 3600]", {}),   # wait / max_age_s: inf
    (f"{CLASS}.rate", 1e6, up(1e6), "0 (off) or in [0.001, 1000000]", {}),
    (f"{CLASS}.rate", 0.001, down(0.001), "0 (off) or in [0.001, 1000000]", {}),     # retry hint 1/rate: inf
    (f"{CLASS}.burst", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    (f"{CLASS}.degrade_max_tokens", TOKENS, TOKENS + 1, "in [0, 16777216]", {}),
    (f"{CLASS}.fast_above_ms", 60_000.0, up(60_000.0), "in [0, 60000]", {}),
    (f"{TENANT}.max_queued", COUNT, COUNT + 1, "in [0, 1048576]", {}),
    (f"{TENANT}.max_running", COUNT, COUNT + 1, "in [0, 1048576]", {}),
    ("workers.restart_backoff_s", 3600.0, up(3600.0), "in (0, 3600]", {"workers.restart_backoff_max_s": 3600.0}),
    ("workers.restart_backoff_max_s", 3600.0, up(3600.0), "in (0, 3600]", {}),
    ("model.max_model_len", TOKENS, TOKENS + 1, "in [16, 16777216]", {}),
    (f"{VERSION}.max_model_len", TOKENS, TOKENS + 1, "in [16, 16777216]", {f"{VERSION}.handler": SCORER}),
    (f"{VERSION}.cache.max_bytes", BYTES, BYTES + 1, "in [0, 281474976710656]", {f"{VERSION}.handler": SCORER}),
    ("engine.pool_bytes", float(BYTES), up(float(BYTES)), "in (0, 281474976710656]", {}),
    ("engine.kv_block_size", 1024, 1025, "in [1, 1024]", {}),
    ("engine.max_num_seqs", 4096, 4097, "in [1, 4096]", {"engine.max_step_tokens": 4096}),
    ("engine.max_step_tokens", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("engine.shared_step_decodes", 4096, 4097, "in [0, 4096]", {}),
    ("pool.bytes", float(BYTES), up(float(BYTES)), "in [0, 281474976710656]", {}),
    ("contexts.max_per_owner", TOKENS, TOKENS + 1, "in [1, 16777216]", {}),
    ("contexts.max_contexts", TOKENS, TOKENS + 1, "in [1, 16777216]", {}),
    ("contexts.max_context_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("contexts.max_field_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("contexts.max_owner_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("contexts.max_total_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("contexts.max_fields", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("cache.bytes", 1 << 42, (1 << 42) + 1, "in [1, 4398046511104]", {}),   # its pages are numbered in 32 bits
    ("cache.page_bytes", 1 << 30, (1 << 30) + 1, "in [4096, 1073741824]", {"cache.bytes": 1 << 40}),
    ("supervisor.stop_grace_s", 3600.0, up(3600.0), "in [0, 3600]", {}),
    ("supervisor.ready_timeout_s", 86400.0, up(86400.0), "in (0, 86400]", {}),
    ("persistence.compact_after_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("http.max_body_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("http.body_timeout_s", 3600.0, up(3600.0), "in (0, 3600]", {}),
    ("http.keepalive_timeout_s", 3600.0, up(3600.0), "in (0, 3600]", {}),
    ("http.max_connections", COUNT, COUNT + 1, "in [1, 1048576]", {}),
    ("cluster.compact_after_bytes", BYTES, BYTES + 1, "in [1, 281474976710656]", {}),
    ("cluster.weight", 1000.0, up(1000.0), "in [0.001, 1000]", {}),
    ("cluster.weight", 0.001, down(0.001), "in [0.001, 1000]", {}),   # the live nodes' shares divide by the sum
    ("cluster.heartbeat_s", down(3600.0), up(3600.0), "in (0, 3600]", {"cluster.node_ttl_s": 3600.0}),
    ("cluster.offload_queued", COUNT, COUNT + 1, "in [0, 1048576]", {}),
]


@pytest.mark.parametrize("key, inside, outside, bound, also", CASES, ids=[f"{c[0]}={c[2]}" for c in CASES])
def test_a_number_just_outside_its_range_is_refused_naming_key_value_and_range(key, inside, outside, bound, also):
    assert read(from_dict(at(key, inside, also)), key) == inside
    with pytest.raises(ConfigError) as refused:
        from_dict(at(key, outside, also))
    assert str(refused.value) == f"{key} = {outside}: must be {bound}"


def _numbers(cls: type, prefix: str):
    """(key, field) of every int or float key of cls's tables, their sub-tables and tables of them."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        item = typing.get_args(hint)[1] if typing.get_origin(hint) is dict else hint
        if dataclasses.is_dataclass(item):
            yield from _numbers(item, f"{prefix}{field.name}.")
        elif hint in (int, float):
            yield f"{prefix}{field.name}", field


NUMBERS = list(_numbers(Config, ""))


def test_every_number_of_every_section_has_a_range_its_default_lies_in():
    assert len(NUMBERS) > 80   # the walk reached the nested tables (classes, tenants, versions)
    unbounded = [key for key, field in NUMBERS if bound_of(field) is None]
    assert unbounded == []
    outside = [key for key, field in NUMBERS if not bound_of(field).holds(field.default)]
    assert outside == []


def test_mcpd_handed_an_out_of_range_number_exits_2_naming_key_value_and_range(tmp_path):
    # 1e12 s of stop grace: a SIGTERM would wait for ever on a request that never ends
    path = tmp_path / "bad.toml"
    path.write_text(f'[server]\ntcp = ""\nruntime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "state"}"\n'
                    "[supervisor]\nstop_grace_s = 1e12\n")
    done = subprocess.run([str(BIN / "mcpd"), "--config", str(path)], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stderr) == (refusal.CONFIG, "mcpd: supervisor.stop_grace_s = 1000000000000.0: "
                                                              "must be in [0, 3600]\n")

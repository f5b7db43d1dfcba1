import os
import subprocess

import pytest

from mcpd import refusal
from mcpd.config import ConfigError, from_dict, load
from mcpd.config.loader import MAX_CONFIG_BYTES
from mcpd.testing import BIN


def test_defaults_are_valid():
    config = from_dict({})
    assert config.engine.kv_block_size == 16 and config.workers.count == 1
    assert not config.cluster.enabled   # one node on its own unless [cluster] names a Redis


@pytest.mark.parametrize("raw, message", [
    ({"nope": {}}, "unknown section [nope]"),
    ({"server": {"tpc": "x"}}, "unknown key server.tpc"),
    ({"workers": {"count": True}}, "workers.count = True"),
    ({"workers": {"count": 0}}, "workers.count = 0"),
    ({"workers": {"threads": 1 << 40}}, "workers.threads = 1099511627776: must be in [0, 1024]"),   # past torch's C int
    ({"server": {"tcp": "http://x"}}, "server.tcp = 'http://x'"),
    # ZeroMQ takes a port past 65535 and binds it modulo 65536 (99999: 34463), and "tcp://" at start
    ({"server": {"tcp": "tcp://127.0.0.1:99999"}}, "server.tcp = 'tcp://127.0.0.1:99999': use host:port, e.g. tcp://"),
    ({"server": {"tcp": "tcp://"}}, "server.tcp = 'tcp://': use host:port"),
    ({"cluster": {"advertise_tcp": "tcp://10.0.0.5:70000"}}, "cluster.advertise_tcp = 'tcp://10.0.0.5:70000': use"),
    ({"model": {"dtype": "int3"}}, "model.dtype = 'int3'"),
    ({"model": {"quantization": "int4"}}, "model.quantization = 'int4'"),
    ({"engine": {"kv_fraction": 1.5}}, "engine.kv_fraction = 1.5"),
    # a byte count under 1 MiB rounds down to an empty pool, which no pool keeper could start with
    ({"engine": {"pool_bytes": 1.5}}, "engine.pool_bytes = 1.5: a fraction in (0, 1] of the free memory, or a byte"),
    ({"pool": {"bytes": 1048575}}, "pool.bytes = 1048575.0: a fraction in (0, 1]"),
    ({"server": "x"}, "[server] must be a table"),
    ({"engine": {"max_num_seqs": 64, "max_step_tokens": 32}}, "engine.max_step_tokens = 32 must be >= engine.max_num_seqs"),
    ({"metrics": {"listen": "0.0.0.0:9464"}}, "not a loopback address"),
    ({"metrics": {"listen": "9464"}}, "use host:port"),
    ({"http": {"listen": "127.0.0.1:\u0668\u0660\u0668\u0660"}}, "use host:port"),   # Arabic-Indic digits
    ({"persistence": {"fsync": "sometimes"}}, "persistence.fsync = 'sometimes'"),
    # it would kill the journal's fsync thread (threading's wait overflows): nothing fsynced again
    ({"persistence": {"fsync_interval_s": 1e300}}, "persistence.fsync_interval_s = 1e+300: must be in (0, 3600]"),
    ({"engine": {"kernels": "native-sse2"}}, "engine.kernels = 'native-sse2': use one of auto, native, native-amx, native-avx512"),
    # TOML has nan and inf; nan passed every range check (a nan batching window held requests forever)
    ({"scheduler": {"window_max_ms": float("nan")}}, "scheduler.window_max_ms = nan: expected a finite number"),
    ({"supervisor": {"stop_grace_s": float("inf")}}, "supervisor.stop_grace_s = inf: expected a finite number"),
    ({"scheduler": {"window_min_ms": 5.0}}, "scheduler.window_max_ms = 0.0: must be >= window_min_ms"),
    # 0 would refuse every one of a shed class, and nothing would show the lease's end (shed_table.py)
    ({"scheduler": {"shed_in_flight": 0}}, "scheduler.shed_in_flight = 0: must be in [1, 1048576]"),
    ({"engine": {"gather_max_ms": -1.0}}, "engine.gather_max_ms = -1.0: must be in [0, 1000]"),
    ({"engine": {"gather_max_ms": float("nan")}}, "engine.gather_max_ms = nan: expected a finite number"),
    ({"supervisor": {"stats_interval_s": 2.0 ** 63}}, "supervisor.stats_interval_s = 9.223372036854776e+18: must be"),
    ({"supervisor": {"stats_interval_s": 0}}, "supervisor.stats_interval_s = 0"),
    ({"http": {"listen": "127.0.0.1:8000", "max_connections": 0}}, "http.max_connections = 0: must be in [1, 1048576]"),
    ({"cluster": {"redis": "http://127.0.0.1:6379"}}, "cluster.redis = 'http://127.0.0.1:6379'"),
    ({"cluster": {"node_id": "a\nb"}}, "cluster.node_id = 'a\\nb'"),
    ({"cluster": {"advertise_tcp": "127.0.0.1:7070"}}, "cluster.advertise_tcp = '127.0.0.1:7070'"),
    ({"cluster": {"redis": "redis://127.0.0.1:6379", "timeout_s": 0}}, "cluster.timeout_s = 0.0: must be in (0, 60]"),
    ({"cluster": {"prefetch_contexts": 100, "recent_contexts": 10}}, "cluster.prefetch_contexts = 100: must be <= recent_contexts = 10"),
    ({"cluster": {"prefetch_contexts": -1}}, "cluster.prefetch_contexts = -1"),
    ({"cluster": {"offload_queued": -1}}, "cluster.offload_queued = -1"),
    # Redis refuses such a heartbeat expiry (the node never joins), and the heartbeat thread's wait overflows
    ({"cluster": {"node_ttl_s": 2e300}}, "cluster.node_ttl_s = 2e+300: must be in (0, 3600]"),
    # TOML's integers are 64-bit and tomllib reads any: one past that would overflow ZeroMQ's option (a
    # front-end crash loop), one past a float's range the loader itself (OverflowError)
    ({"limits": {"max_message_bytes": 1 << 70}}, "limits.max_message_bytes = 1180591620717411303424: expected a 64-bit"),
    ({"engine": {"gather_max_ms": 10 ** 400}}, "engine.gather_max_ms = 1000000"),
    ({"models": {"m": {"split": {"a": -10 ** 400}, "versions": {"a": {}}}}}, "models.m.split.a = -1000000"),
    # A NUL would raise ValueError out of the group lookup (admin_group) or out of mkdir at start (runtime_dir)
    ({"security": {"admin_group": "wheel\0"}}, "security.admin_group = 'wheel\\x00': holds a NUL character"),
    ({"server": {"runtime_dir": "/run/mcpd\0x"}}, "server.runtime_dir = '/run/mcpd\\x00x': holds a NUL"),
    ({"cluster": {"peer_tenants": ["a", "b\0"]}}, "cluster.peer_tenants = ['a', 'b\\x00']: holds a NUL"),
])
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(ConfigError) as raised:
        from_dict(raw)
    assert message in str(raised.value)


def test_a_config_file_nested_past_what_the_toml_reader_recurses_is_a_config_error(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("[models.risk.versions.v1]\nsettings = { rules = " + "[" * 2000 + "]" * 2000 + " }\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert "nest too deep" in str(e.value)


@pytest.mark.parametrize("literal, message", [
    ("1" + "0" * 5000, "config file {path}: a number too long to read"),   # int() refuses it inside tomllib
    ("0x1" + "0" * 5000, "engine.max_num_seqs = (a number too long to show): expected a 64-bit integer"),
])
def test_an_integer_too_long_for_python_is_a_config_error(tmp_path, literal, message):
    path = tmp_path / "mcpd.toml"
    path.write_text(f"[engine]\nmax_num_seqs = {literal}\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert str(e.value) == message.format(path=path)


def test_ints_accepted_for_floats():
    assert from_dict({"engine": {"pool_bytes": 1 << 20}}).engine.pool_bytes == 1048576.0


# What the shipped file turns on that the built-in defaults leave off: a real model and HTTP on
# loopback for `make run` and the systemd unit; tests and a config-less start keep the embedded
# model and no listener.
SHIPPED_NOT_DEFAULT = {("model", "path"): "auto", ("http", "listen"): "127.0.0.1:8000"}


def test_shipped_config_lists_every_key_with_its_default():
    import tomllib
    from pathlib import Path

    from mcpd.config import Config
    shipped = tomllib.loads((Path(__file__).parent.parent / "etc" / "mcpd.toml").read_text())
    for section, keys in Config().to_dict().items():
        for key, default in keys.items():
            expected = SHIPPED_NOT_DEFAULT.get((section, key), default)
            expected = list(expected) if isinstance(expected, tuple) else expected   # TOML's arrays are lists
            assert shipped.get(section, {}).get(key) == expected, f"{section}.{key}"


MODELS = {"models": {"m": {"default": "a", "versions": {"a": {"workers": 2}, "b": {"dtype": "float32", "loaded": False}}}}}


def test_a_config_with_model_alone_is_one_model_with_one_version():
    config = from_dict({"model": {"dtype": "float32"}, "workers": {"count": 2}})
    assert config.default_model == "default" and config.worker_versions() == [("default", "default")] * 2
    assert config.model_table["default"].versions["default"].dtype == "float32"
    assert config.for_worker("default", "default") is config


def test_each_version_gets_its_workers_and_its_model_section():
    config = from_dict(MODELS)
    assert config.default_model == "m"
    assert config.worker_versions() == [("m", "a"), ("m", "a"), ("m", "b")]
    worker = config.for_worker("m", "b")
    assert worker.model.dtype == "float32" and worker.workers.count == 3


@pytest.mark.parametrize("raw, message", [
    ({"models": {"m": {}}}, "models.m: no versions"),
    ({"models": {"m m": {"versions": {"a": {}}}}}, "models.m m: a model name is"),
    ({"models": {"m": {"versions": {"a/b": {}}}}}, "models.m.versions.a/b: a version name is"),
    ({"models": {"m": {"versions": {"a": {"dtype": "int3"}}}}}, "models.m.versions.a.dtype = 'int3'"),
    ({"models": {"m": {"versions": {"a": {"workers": 0}}}}}, "models.m.versions.a.workers = 0"),
    ({"models": {"m": {"versions": {"a": {}, "b": {}}}}}, "models.m.default: say which"),
    ({"models": {"m": {"default": "z", "versions": {"a": {}}}}}, "models.m.default = 'z'"),
    ({"models": {"m": {"versions": {"a": {"loaded": False}}}}}, "the default version must be loaded"),
    ({"models": {"m": {"split": {"z": 1}, "versions": {"a": {}}}}}, "models.m.split.z: not a loaded version"),
    ({"models": {"m": {"split": {"a": -1}, "versions": {"a": {}}}}}, "models.m.split.a = -1.0"),
    ({"models": {"m": {"split": {"a": "x"}, "versions": {"a": {}}}}}, "models.m.split.a = 'x': expected"),
    ({"models": {"m": {"split": {"a": 0}, "versions": {"a": {}}}}}, "at least one version needs a weight"),
    ({"models": {"m": 1}}, "[models.m] must be a table"),
    ({"models": {"m": {"versions": {"a": {"wat": 1}}}}}, "unknown key models.m.versions.a.wat"),
    ({**MODELS, "model": {}}, "[model] and [models] are both set"),
    ({**MODELS, "workers": {"count": 2}}, "workers.count is set with [models]"),
    ({**MODELS, "routing": {"default_model": "x"}}, "routing.default_model = 'x': not one of"),
    ({"routing": {"default_model": "x"}}, "there is no [models] table"),
    ({"models": {"m": {"versions": {"a": {"workers": 200}, "b": {"workers": 100}}, "default": "a"}}}, "at most 256"),
])
def test_hostile_model_tables_are_refused_naming_the_key(raw, message):
    with pytest.raises(ConfigError) as raised:
        from_dict(raw)
    assert message in str(raised.value)


def _fifo(path):
    os.mkfifo(path)


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "Is a directory"),
    (lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
    (_fifo, "not a regular file"),   # opened without waiting for a writer that never comes
    (lambda p: p.write_bytes(b'[server]\nlog_level = "info"\n# caf\xe9\n'), "not UTF-8 text (byte 33)"),
    (lambda p: p.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1)), f"{MAX_CONFIG_BYTES + 1} bytes, more than the {MAX_CONFIG_BYTES} it may hold"),
])
def test_a_config_path_that_is_no_config_file_is_a_config_error(tmp_path, make, message):
    path = tmp_path / "mcpd.toml"
    make(path)
    with pytest.raises(ConfigError) as e:
        load(path)
    assert f"config file {path}: {message}" in str(e.value)


def test_mcpd_started_on_a_directory_for_its_config_exits_2_with_the_reason(tmp_path):
    done = subprocess.run([str(BIN / "mcpd"), "--config", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (refusal.CONFIG, f"mcpd: config file {tmp_path}: Is a directory\n")

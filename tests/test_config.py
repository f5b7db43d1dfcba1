import pytest

from mcpd.config import ConfigError, from_dict


def test_defaults_are_valid():
    config = from_dict({})
    assert config.engine.kv_block_size == 16 and config.workers.count == 1


@pytest.mark.parametrize("raw, message", [
    ({"nope": {}}, "unknown section [nope]"),
    ({"server": {"tpc": "x"}}, "unknown key server.tpc"),
    ({"workers": {"count": True}}, "workers.count = True"),
    ({"workers": {"count": 0}}, "workers.count = 0"),
    ({"server": {"tcp": "http://x"}}, "server.tcp = 'http://x'"),
    ({"model": {"dtype": "int3"}}, "model.dtype = 'int3'"),
    ({"model": {"quantization": "int4"}}, "model.quantization = 'int4'"),
    ({"engine": {"kv_fraction": 1.5}}, "engine.kv_fraction = 1.5"),
    ({"server": "x"}, "[server] must be a table"),
    ({"engine": {"max_num_seqs": 64, "max_step_tokens": 32}}, "engine.max_step_tokens = 32 must be >= engine.max_num_seqs"),
    ({"metrics": {"listen": "0.0.0.0:9464"}}, "not a loopback address"),
    ({"metrics": {"listen": "9464"}}, "use host:port"),
    ({"persistence": {"fsync": "sometimes"}}, "persistence.fsync = 'sometimes'"),
    # TOML has nan and inf; nan passed every range check (a nan batching window held requests forever)
    ({"scheduler": {"window_max_ms": float("nan")}}, "scheduler.window_max_ms = nan: expected a finite number"),
    ({"supervisor": {"stop_grace_s": float("inf")}}, "supervisor.stop_grace_s = inf: expected a finite number"),
    ({"scheduler": {"window_min_ms": 5.0}}, "scheduler.window_max_ms = 0.0: must be >= window_min_ms"),
])
def test_bad_values_name_the_key(raw, message):
    with pytest.raises(ConfigError) as raised:
        from_dict(raw)
    assert message in str(raised.value)


def test_ints_accepted_for_floats():
    assert from_dict({"engine": {"pool_bytes": 1024}}).engine.pool_bytes == 1024.0


def test_shipped_config_lists_every_key_with_its_default():
    import tomllib
    from pathlib import Path

    from mcpd.config import Config
    shipped = tomllib.loads((Path(__file__).parent.parent / "etc" / "mcpd.toml").read_text())
    for section, keys in Config().to_dict().items():
        for key, default in keys.items():
            assert shipped.get(section, {}).get(key) == default, f"{section}.{key}"

"""A handler version's config ([models.<name>.versions.<v>] with `handler`): its sub-tables built
and checked, every bad value refused naming its key, and the shipped example block valid."""
import re
import tomllib
from functools import reduce
from pathlib import Path

import pytest

from mcpd.config import ConfigError, from_dict
from mcpd.config.handlers import BatchingConfig

SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"


def version(**keys) -> dict:
    return {"models": {"risk": {"versions": {"v1": {"handler": SCORER, **keys}}}}}


def test_a_handler_version_builds_its_tables():
    config = from_dict(version(settings={"seed": 3, "name": "x"}, quantization="int8",
                               batching={"max_batch_size": 32, "preferred_batch_sizes": [8, 16], "length_bins": [16, 64]},
                               cache={"max_bytes": 1 << 20}))
    v1 = config.models["risk"].versions["v1"]
    assert v1.kind == "handler" and v1.settings == {"seed": 3, "name": "x"} and v1.quantization == "int8"
    assert v1.batching == BatchingConfig(32, 2.0, (8, 16), (16, 64))
    assert v1.cache.max_bytes == 1 << 20 and v1.handler_timeout_s == 30.0


@pytest.mark.parametrize("keys, message", [
    ({"handler": "risk_scorer"}, 'handler = \'risk_scorer\': name it as "package.module:Class"'),
    ({"handler": "a b:C"}, "name it as"),
    ({"path": "/srv/models/llama"}, "a handler version has no path"),
    ({"handler_timeout_s": 0}, "handler_timeout_s = 0.0: must be in (0, 3600]"),
    ({"settings": 3}, "settings = 3: expected"),
    ({"batching": 4}, "batching = 4: expected a table"),
    ({"batching": {"max_batch_size": -1}}, "batching.max_batch_size = -1"),
    ({"batching": {"max_batch_size": 1 << 20}}, "batching.max_batch_size = 1048576"),
    ({"batching": {"max_queue_delay_ms": -1}}, "batching.max_queue_delay_ms = -1.0"),
    ({"batching": {"preferred_batch_sizes": [128]}}, "preferred_batch_sizes: 128 is not in 1..max_batch_size"),
    ({"batching": {"preferred_batch_sizes": [16, 8]}}, "smallest first"),
    ({"batching": {"length_bins": [0]}}, "length_bins: each bin is 1.."),
    ({"batching": {"length_bins": ["16"]}}, "length_bins = ['16']: expected a list of integers"),
    ({"batching": {"max_rows": 4}}, "unknown key models.risk.versions.v1.batching.max_rows"),
    ({"cache": {"max_bytes": -1}}, "cache.max_bytes = -1"),
    ({"cache": {"warmup": "/tmp/w"}}, "warmup is set with max_bytes = 0"),
    ({"settings": {"layers": reduce(lambda inner, _: [inner], range(32), [])}},
     "settings: tables and arrays may nest at most 32 deep"),
])
def test_bad_handler_config_is_refused_naming_the_key(keys, message):
    with pytest.raises(ConfigError) as e:
        from_dict(version(**keys))
    assert message in str(e.value), str(e.value)


def test_the_shipped_example_block_is_valid():
    text = (Path(__file__).parent.parent / "etc" / "mcpd.toml").read_text()
    block = re.search(r"^# \[models\.risk\]\n(?:^#.*\n)+", text, re.M).group(0)
    raw = tomllib.loads("\n".join(line[2:] for line in block.splitlines()))
    config = from_dict(raw)
    assert config.models["risk"].versions["v1"].kind == "handler" and config.models["risk"].fast == "rules"

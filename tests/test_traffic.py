"""The model table's traffic policies in-process (mcpd/daemon/scheduler/traffic.py): routing by name,
split by weighted rendezvous hashing, promote, rollback, load and unload."""
import pytest

from mcpd.config import from_dict
from mcpd.daemon.scheduler.traffic import Traffic, split_choice, unit_draw
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.control_results import TrafficPolicy


def table(**model):
    versions = {"a": {}, "b": {}, "c": {"loaded": False}}
    return from_dict({"models": {"m": {"default": "a", "versions": versions, **model},
                                 "n": {"versions": {"x": {}}}}})


def traffic(**model) -> Traffic:
    config = table(**model)
    return Traffic(config.model_table, config.default_model)


def test_a_request_gets_the_default_model_and_its_primary_unless_it_names_them():
    t = traffic()
    assert t.route(None, None, "t1") == ("m", "a")
    assert t.route("n", None, "t1") == ("n", "x")
    assert t.route("m", "b", "t1") == ("m", "b")


@pytest.mark.parametrize("model, version, says", [
    ("nope", None, "no model 'nope'"),
    ("m", "zz", "has no version 'zz'"),
    ("m", "c", "is not loaded"),
])
def test_a_model_or_version_not_served_is_refused_with_its_code(model, version, says):
    with pytest.raises(MCPDError) as refused:
        traffic().route(model, version, "t1")
    assert refused.value.code == codes.UNKNOWN_MODEL and says in refused.value.message


def test_split_follows_the_weights_within_one_percent_and_each_key_stays_put():
    t = traffic()
    t.split("m", {"a": 70, "b": 30})
    keys = [f"tenant-{i}" for i in range(10_000)]
    first = [t.route("m", None, k)[1] for k in keys]
    assert abs(first.count("b") / len(keys) - 0.30) <= 0.01
    assert [t.route("m", None, k)[1] for k in keys] == first


@pytest.mark.parametrize("huge, small", [({"a": 1e308, "b": 1e308}, {"a": 1, "b": 1}),
                                         ({"a": 3e307, "b": 1e307}, {"a": 3, "b": 1})])
def test_huge_weights_route_every_key_as_their_proportional_small_weights_do(huge, small):
    keys = [f"tenant-{i}" for i in range(5000)]
    routed = []
    for weights in (huge, small):
        t = traffic()
        t.split("m", weights)
        routed.append([t.route("m", None, k)[1] for k in keys])
    assert routed[0] == routed[1]
    assert t.describe()["m"].split == {"a": float(small["a"]), "b": float(small["b"])}   # shown as given


def test_raising_one_weight_moves_keys_only_toward_that_version():
    split = (("a", 80.0), ("b", 20.0))
    before = {k: split_choice(k, "m", split) for k in map(str, range(5000))}
    after = {k: split_choice(k, "m", (("a", 50.0), ("b", 50.0))) for k in before}
    assert all(after[k] == "b" for k in before if before[k] == "b")
    assert sum(v == "b" for v in after.values()) > sum(v == "b" for v in before.values())


def test_promote_then_rollback_then_rollback_of_a_split():
    t = traffic()
    assert t.promote("m", "b").primary == "b"
    assert t.route(None, None, "k") == ("m", "b")
    assert t.rollback("m").primary == "a"
    t.split("m", {"a": 1, "b": 1})
    assert t.rollback("m") == TrafficPolicy("m", "a", {})
    with pytest.raises(MCPDError) as nothing:
        t.rollback("m")
    assert nothing.value.code == codes.CONFLICT


def test_a_version_that_takes_traffic_cannot_be_unloaded_and_an_unloaded_one_takes_none():
    t = traffic()
    with pytest.raises(MCPDError) as busy:
        t.unload("m", "a")
    assert busy.value.code == codes.CONFLICT
    with pytest.raises(MCPDError) as unloaded:
        t.promote("m", "c")
    assert unloaded.value.code == codes.CONFLICT
    t.load("m", "c")
    t.promote("m", "c")
    t.unload("m", "a")
    with pytest.raises(MCPDError) as gone:   # rollback would send traffic to an unloaded version
        t.rollback("m")
    assert gone.value.code == codes.CONFLICT and t.route("m", None, "k") == ("m", "c")


@pytest.mark.parametrize("weights", [{"a": -1}, {"a": 0, "b": 0}, {"a": float("nan")}, {"zz": 1}, {"c": 1}])
def test_hostile_split_weights_are_refused(weights):
    with pytest.raises(MCPDError):
        traffic().split("m", weights)


def test_a_reload_keeps_the_live_policy_unless_the_models_entry_changed():
    t = traffic()
    t.promote("m", "b")
    config = table()
    assert t.configure(config.model_table, config.default_model) == []
    assert t.route("m", None, "k") == ("m", "b")
    config = table(split={"a": 1, "b": 3})
    assert t.configure(config.model_table, config.default_model) == ["m"]
    assert t.describe()["m"].split == {"a": 1.0, "b": 3.0}


def test_a_draw_is_strictly_inside_zero_and_one():
    """-weight / ln(u) needs u < 1; an all-ones digest once rounded to exactly 1.0."""
    assert 0 < unit_draw(bytes(8)) < unit_draw(b"\x80" + bytes(7)) < unit_draw(b"\xff" * 8) < 1

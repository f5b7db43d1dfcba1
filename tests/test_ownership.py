"""Rendezvous ownership (mcpd/cluster/ownership.py), socket-free: balance over 100 nodes and 1M
contexts, a node's loss moves only its own contexts, weights set the shares, and the one-context
answer agrees with the bulk one."""
import numpy as np
import pytest

from mcpd.cluster.node_report import NodeReport
from mcpd.cluster.ownership import Ownership, context_hash, serving

NODES = [f"node-{i}" for i in range(100)]


def keys(count: int) -> np.ndarray:
    return np.array([context_hash("tenant", f"ctx-{i}") for i in range(count)], np.uint64)


@pytest.fixture(scope="module")
def million():
    """A million contexts and their owners among the 100 nodes."""
    contexts, ownership = keys(1_000_000), Ownership(dict.fromkeys(NODES, 1.0))
    return contexts, ownership, ownership.owners(contexts)


@pytest.mark.slow
def test_a_million_contexts_spread_evenly_over_100_nodes(million):
    counts = np.bincount(million[2], minlength=len(NODES))
    assert counts.max() / counts.mean() <= 1.05


@pytest.mark.slow
def test_a_node_leaving_moves_only_its_own_contexts(million):
    contexts, before, was = million
    leaving = before.nodes.index("node-42")
    after = Ownership({n: 1.0 for n in NODES if n != "node-42"})
    now = np.array([before.nodes.index(n) for n in after.nodes])[after.owners(contexts)]
    moved = was != now
    assert set(was[moved].tolist()) == {leaving}   # nobody else's context moved
    assert moved.mean() * len(NODES) <= 1.1


def test_weights_set_the_shares():
    weights = {"big": 3.0, "small": 1.0}
    counts = np.bincount(Ownership(weights).owners(keys(40_000)), minlength=2)
    share = dict(zip(sorted(weights), counts / counts.sum()))
    assert abs(share["big"] - 0.75) < 0.02 and abs(share["small"] - 0.25) < 0.02


def test_one_context_gets_the_owner_the_bulk_answer_gives():
    ownership = Ownership(dict.fromkeys(NODES[:7], 1.0) | {"heavy": 2.5})
    sample = keys(500)
    assert [ownership.owner(int(k)) for k in sample] == [ownership.nodes[i] for i in ownership.owners(sample)]


def test_no_nodes_or_a_weightless_one_is_refused():
    for weights in ({}, {"a": 1.0, "b": 0.0}):
        with pytest.raises(ValueError):
            Ownership(weights)


def test_only_nodes_serving_a_model_with_a_sane_weight_own_contexts():
    reports = {"ready": NodeReport(weight=2, models=["default/default"]),
               "loading": NodeReport(weight=1.0),                       # restarted: no worker ready yet
               "idle": NodeReport(weight=1.0, models=[]),
               "zero": NodeReport(weight=0, models=["m/a"]), "nan": NodeReport(weight=float("nan"), models=["m/a"]),
               "inf": NodeReport(weight=float("inf"), models=["m/a"]), "negative": NodeReport(weight=-1.0, models=["m/a"])}
    assert serving(reports) == {"ready": 2.0}
    assert Ownership(serving(reports)).owner(context_hash("t", "c")) == "ready"

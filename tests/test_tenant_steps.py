"""Bounded steps while tenants share an engine (engine.shared_step_decodes), in-process on the
embedded model: a newcomer's first token comes from a short step, not from one with another
tenant's whole batch; the batch's sequences take turns and produce the tokens they would alone;
a lone tenant's steps stay whole, and so do they again once the other tenant has been away."""
import pytest
import torch
from fakes import Clock

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine, SamplingParams
from mcpd.engine.active_tenants import ACTIVE_S
from mcpd.engine.engine import PROCESS_THREADS

FLOOD = 40
BOUND = EngineConfig().shared_step_decodes
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def make_engine() -> tuple[Engine, Clock]:
    engine = Engine(Config(model=ModelConfig(max_model_len=512), engine=EngineConfig(pool_bytes=64 << 20)),
                    torch.device("cpu"))
    clock = Clock()
    engine.tenants.clock = clock
    return engine, clock


def flood(engine: Engine, count: int = FLOOD) -> list:
    """Tenant a's long requests, prefilled and decoding; the outputs of their first step."""
    for i in range(count):
        engine.add_request(("a", i), engine.tokenizer.encode(f"flood {i}"), LONG, cache_namespace="a")
    return engine.step()


def tenants_in_step(outputs) -> dict[str, int]:
    counts = {}
    for out in outputs:
        counts[out.key[0]] = counts.get(out.key[0], 0) + 1
    return counts


def test_a_newcomers_first_token_comes_from_a_step_of_its_own_not_the_floods_batch():
    engine, _ = make_engine()
    flood(engine)
    assert tenants_in_step(engine.step()) == {"a": FLOOD}   # alone, a's batch runs whole
    engine.add_request(("b", 0), engine.tokenizer.encode("victim"), ONE, cache_namespace="b")
    first = engine.step()
    assert tenants_in_step(first) == {"b": 1}
    assert [out.finished for out in first] == [True]
    assert tenants_in_step(engine.step()) == {"a": BOUND}   # b lately active: a's steps stay short


def test_a_tenant_with_a_sequence_running_is_no_newcomer():
    engine, _ = make_engine()
    flood(engine)
    engine.add_request(("b", 0), engine.tokenizer.encode("victim"), LONG, cache_namespace="b")
    assert tenants_in_step(engine.step()) == {"b": 1}
    engine.add_request(("b", 1), engine.tokenizer.encode("second"), ONE, cache_namespace="b")
    step = engine.step()   # b's second request joins a bounded step; b's decode waits for its turn like a's
    assert tenants_in_step(step) == {"a": BOUND, "b": 1}
    assert [out.key for out in step if out.key[0] == "b"] == [("b", 1)]


def test_a_newcomer_without_a_free_seat_waits_and_the_others_go_on():
    engine = Engine(Config(model=ModelConfig(max_model_len=512),
                           engine=EngineConfig(pool_bytes=64 << 20, max_num_seqs=FLOOD)), torch.device("cpu"))
    flood(engine)
    engine.add_request(("b", 0), engine.tokenizer.encode("victim"), ONE, cache_namespace="b")
    assert tenants_in_step(engine.step()) == {"a": BOUND}


def test_the_floods_sequences_take_turns_while_another_tenant_is_active():
    engine, clock = make_engine()
    flood(engine)
    engine.add_request(("b", 0), engine.tokenizer.encode("victim"), ONE, cache_namespace="b")
    advanced = {("a", i): 0 for i in range(FLOOD)}
    for _ in range(6):   # b's own step, then b away but lately active: 5 steps of 16 = 2 tokens each of a's 40
        for out in engine.step():
            if out.key[0] == "a":
                advanced[out.key] += 1
    assert set(advanced.values()) == {2}
    clock.now += ACTIVE_S + 0.01
    assert tenants_in_step(engine.step()) == {"a": FLOOD}   # b gone quiet: a's steps whole again


def test_bounded_steps_give_the_flood_the_tokens_it_gets_alone():
    results, widest = {}, {}
    for shared in (False, True):
        engine, _ = make_engine()
        outputs = flood(engine, 20)
        if shared:
            engine.add_request(("b", 0), engine.tokenizer.encode("victim"), LONG, cache_namespace="b")
        tokens, widest[shared] = {}, 0
        while outputs or engine.has_work:
            for out in outputs:
                tokens.setdefault(out.key, []).extend(out.token_ids)
            outputs = engine.step()
            widest[shared] = max(widest[shared], tenants_in_step(outputs).get("a", 0))
        results[shared] = {key: ids for key, ids in tokens.items() if key[0] == "a"}
    assert widest == {False: 20, True: BOUND}
    assert results[True] == results[False]
    assert all(len(ids) == LONG.max_tokens for ids in results[True].values())


def test_a_tenant_per_request_is_forgotten_a_second_later():
    """With authentication off a client may name a new tenant for every request: the engine
    remembers a tenant's last request for ACTIVE_S only, whatever else is active."""
    engine, clock = make_engine()
    flood(engine, 2)
    engine.add_request(("b", 0), engine.tokenizer.encode("victim"), LONG, cache_namespace="b")
    for i in range(500):
        engine.add_request(("x", i), [1, 2, 3], ONE, cache_namespace=f"x{i}")
        engine.abort(("x", i))
    clock.now += ACTIVE_S + 0.01
    engine.step()
    assert set(engine.tenants.last_arrival) <= {"a", "b"} and set(engine.tenants.live) == {"a", "b"}


@pytest.mark.skipif(PROCESS_THREADS < 2, reason="one thread: no core to leave")
def test_while_tenants_share_the_engine_its_steps_leave_a_core_to_the_other_processes():
    engine, clock = make_engine()
    flood(engine)
    assert torch.get_num_threads() == PROCESS_THREADS   # a lone tenant: every thread
    engine.add_request(("b", 0), engine.tokenizer.encode("victim"), ONE, cache_namespace="b")
    engine.step()
    assert torch.get_num_threads() == PROCESS_THREADS - 1
    clock.now += ACTIVE_S + 0.01
    engine.step()
    assert torch.get_num_threads() == PROCESS_THREADS

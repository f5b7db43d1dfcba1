"""The worker's core in-process, on a real engine (the embedded model): typed messages and a clock
in, typed messages out, no sockets. What crosses processes (a killed worker, replies reaching
clients) stays with the daemon tests."""
import logging

import msgpack
import numpy as np
import pytest
import torch

from mcpd.config import Config, EngineConfig, LimitsConfig, ModelConfig
from mcpd.daemon import messages
from mcpd.daemon.child_stats import WorkerStats
from mcpd.daemon.scheduler.prompt_tokens import prompt_token_ids
from mcpd.daemon.worker.core import MAX_FAILED_STEPS, WorkerCore
from mcpd.daemon.worker.done_notes import DONE_FLUSH_S
from mcpd.engine import Engine
from mcpd.protocol import codes
from mcpd.protocol.args import GenerateArgs, PingArgs
from mcpd.protocol.results import Degraded, GenerateResult, Usage
from mcpd.protocol.sampling import SamplingParams
from fakes import Clock, Ports, decoded

CONFIG = Config(model=ModelConfig(max_model_len=512), engine=EngineConfig(pool_bytes=16 << 20),
                limits=LimitsConfig(max_prompt_tokens=64))


@pytest.fixture(scope="module")
def engine():
    return Engine(CONFIG, torch.device("cpu"))


@pytest.fixture
def core(engine):
    yield WorkerCore(CONFIG, 3, engine, logging.getLogger("test"), Ports(), Clock())
    assert not engine.has_work and engine.stats()["kv_blocks_used"] == 0   # every test leaves it clean


def dispatch(core, rid: int, args, turn: bool = False, history: list[int] | None = None,
             degraded: Degraded | None = None):
    """As the scheduler sends it: the prompt tokenized there (a turn's without BOS)."""
    ids = prompt_token_ids(core.engine.tokenizer, args, not history, CONFIG.limits.max_prompt_tokens) \
        if isinstance(args, GenerateArgs) else []
    message = messages.Dispatch(rid, f"req-{rid}", "t", 0, turn, args, ids, degraded=degraded)
    payload = [np.asarray(history or [], np.int32).tobytes()] if turn else []
    core.on_message(*decoded(messages.encode(message, *payload)))


def run_until_idle(core, tick_s: float = 0.0) -> None:
    while core.has_work:
        core.step()
        core.clock.now += tick_s
    core.flush_done()


def replies(sent, kind) -> list[tuple[messages.Message, dict]]:
    return [(m, msgpack.unpackb(frames[0])) for m, frames in sent if isinstance(m, kind)]


def of_kind(sent, kind) -> list[messages.Message]:
    return [m for m, _ in sent if isinstance(m, kind)]


def greedy(max_tokens: int, prompt: str = "hello", stream: bool = False, logprobs: bool = False) -> GenerateArgs:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return GenerateArgs(prompt=prompt, sampling=sampling, stream=stream)


def test_a_generate_runs_to_a_final_for_the_frontend_and_a_done_note(core, engine):
    dispatch(core, 1, greedy(5))
    assert core.has_work and core.poll_timeout_ms(100) == 0
    run_until_idle(core)
    [(final, reply)] = replies(core.ports.frontend, messages.Final)
    assert final.rid == 1 and final.code is None
    assert reply["kind"] == "ok" and reply["id"] == "req-1"
    result = reply["result"]
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 5
    assert result["usage"] == {"prompt_tokens": 6, "completion_tokens": 5}   # BOS + "hello"
    assert result["text"] == engine.tokenizer.decode(result["token_ids"])
    assert of_kind(core.ports.scheduler, messages.Done) == [messages.Done([1])]


def test_a_ping_is_answered_without_the_engine(core):
    dispatch(core, 2, PingArgs())
    assert not core.has_work
    [(final, reply)] = replies(core.ports.frontend, messages.Final)
    assert reply["result"] == {"pong": True, "worker": 3}


def test_a_flush_puts_a_flushed_marker_behind_every_reply_sent(core):
    dispatch(core, 2, PingArgs())
    core.on_message(*decoded(messages.encode(messages.Flush())))
    assert [type(m) for m, _ in core.ports.frontend] == [messages.Final, messages.Flushed]
    assert core.ports.frontend[1][0] == messages.Flushed(3)


def test_a_stream_sends_started_then_chunks_that_add_up_to_the_final(core):
    dispatch(core, 1, greedy(6, stream=True, logprobs=True))
    run_until_idle(core, tick_s=1.0)   # the clock passes each chunk's earliest time: a chunk per step
    chunks = replies(core.ports.frontend, messages.Chunk)
    [(_, final)] = replies(core.ports.frontend, messages.Final)
    assert [reply["seq"] for _, reply in chunks] == list(range(6))
    assert sum((reply["data"]["token_ids"] for _, reply in chunks), []) == final["result"]["token_ids"]
    assert sum(len(reply["data"]["logprobs"]) for _, reply in chunks) == 6
    assert isinstance(core.ports.scheduler[0][0], messages.Started)   # before any retry could repeat output


def test_chunks_are_merged_when_the_clock_says_too_soon(core):
    dispatch(core, 1, greedy(6, stream=True))
    run_until_idle(core)   # the clock stands still: the first step's chunk, then the rest with the final
    chunks = replies(core.ports.frontend, messages.Chunk)
    assert [len(reply["data"]["token_ids"]) for _, reply in chunks] == [1, 5]


def test_a_cancel_frees_the_request_and_answers_with_its_code(core, engine):
    dispatch(core, 1, greedy(50))
    dispatch(core, 2, greedy(50))
    core.step()
    core.on_message(*decoded(messages.encode(messages.Cancel(1, codes.DEADLINE_EXCEEDED))))
    core.on_message(*decoded(messages.encode(messages.Cancel(2, codes.OVERLOADED))))
    core.on_message(*decoded(messages.encode(messages.Cancel(9, codes.CANCELLED))))   # not here: nothing to do
    run_until_idle(core)
    finals = {m.rid: (m.code, reply) for m, reply in replies(core.ports.frontend, messages.Final)}
    assert finals[1][0] == finals[1][1]["code"] == codes.DEADLINE_EXCEEDED
    assert "while running" in finals[1][1]["message"]
    assert finals[2][1]["retry_after_ms"] == CONFIG.scheduler.overloaded_retry_ms
    assert sorted(finals) == [1, 2]


def test_a_request_the_engine_refuses_is_answered_bad_request(core):
    dispatch(core, 1, GenerateArgs(prompt_token_ids=[1, 100_000], sampling=SamplingParams(max_tokens=2)))
    dispatch(core, 2, greedy(600))   # over max_model_len
    finals = replies(core.ports.frontend, messages.Final)
    assert [(m.rid, m.code, reply["code"]) for m, reply in finals] == \
        [(rid, codes.BAD_REQUEST, codes.BAD_REQUEST) for rid in (1, 2)]
    assert "max_model_len 512" in finals[1][1]["message"] and not core.has_work
    core.flush_done()
    assert of_kind(core.ports.scheduler, messages.Done) == [messages.Done([1, 2])]


def test_a_context_turn_answers_through_the_scheduler_with_what_it_appends(core, engine):
    history = engine.tokenizer.encode("earlier turns")
    dispatch(core, 1, greedy(4, prompt=" and now", stream=True), turn=True, history=history)
    run_until_idle(core)
    assert core.ports.frontend == []   # nothing bypasses the scheduler's commit
    [turn] = of_kind(core.ports.scheduler, messages.TurnResult)
    added = engine.tokenizer.encode(" and now", add_special_tokens=False)   # no BOS inside a history
    assert turn.appended == added + turn.result.token_ids
    assert turn.result.prompt_tokens == len(history) + len(added)
    assert of_kind(core.ports.scheduler, messages.Chunk) and not of_kind(core.ports.scheduler, messages.Done)


def test_a_turn_refused_ends_through_the_scheduler(core):
    dispatch(core, 1, GenerateArgs(prompt_token_ids=[100_000], sampling=SamplingParams(max_tokens=2)), turn=True,
             history=[1, 2])
    [(final, reply)] = replies(core.ports.scheduler, messages.Final)
    assert final.code == reply["code"] == codes.BAD_REQUEST and core.ports.frontend == []


def test_the_degradation_cap_is_run_from_the_args_and_said(core):
    """The scheduler shortened the args (Admission); the worker runs them and passes its note on."""
    dispatch(core, 1, greedy(3), degraded=Degraded(3, 20))
    run_until_idle(core)
    [(_, reply)] = replies(core.ports.frontend, messages.Final)
    assert len(reply["result"]["token_ids"]) == 3
    assert reply["result"]["degraded"] == {"max_tokens": 3, "requested_max_tokens": 20}


def test_a_generate_result_is_the_typed_struct_and_its_documented_map(core, engine):
    """A turn's result crosses to the scheduler as a GenerateResult, not a map; to a client it is
    the map docs/PROTOCOL.md lists, the fields left at their default (logprobs, degraded) left out."""
    dispatch(core, 1, greedy(3, prompt=" more"), turn=True, history=engine.tokenizer.encode("before"))
    dispatch(core, 2, greedy(3))
    run_until_idle(core)
    [turn] = of_kind(core.ports.scheduler, messages.TurnResult)
    assert type(turn.result) is GenerateResult and type(turn.result.usage) is Usage
    [(_, reply)] = replies(core.ports.frontend, messages.Final)
    assert sorted(reply["result"]) == ["finish_reason", "model", "text", "token_ids", "usage", "version"]


def test_done_notes_wait_while_the_engine_is_busy_then_go_together(core):
    dispatch(core, 1, greedy(1))
    dispatch(core, 2, greedy(40))
    while not core.done:
        core.step()
    core.flush_done()
    assert of_kind(core.ports.scheduler, messages.Done) == []   # held: the engine still runs request 2
    core.clock.now += DONE_FLUSH_S
    core.flush_done()
    assert of_kind(core.ports.scheduler, messages.Done) == [messages.Done([1])]
    run_until_idle(core)
    assert of_kind(core.ports.scheduler, messages.Done) == [messages.Done([1]), messages.Done([2])]


def test_a_pings_done_note_waits_for_company_and_goes_with_work_that_ends_the_engines(core):
    """A ping is no work (done_notes.py): its note waits, and a generate that leaves the engine
    idle takes it along at once."""
    dispatch(core, 1, PingArgs())
    core.flush_done()
    assert of_kind(core.ports.scheduler, messages.Done) == [] and core.poll_timeout_ms(100) == pytest.approx(DONE_FLUSH_S * 1e3)
    dispatch(core, 2, greedy(2))
    run_until_idle(core)
    assert of_kind(core.ports.scheduler, messages.Done) == [messages.Done([1, 2])]
    dispatch(core, 3, PingArgs())
    core.clock.now += DONE_FLUSH_S
    core.flush_done()
    assert of_kind(core.ports.scheduler, messages.Done)[1:] == [messages.Done([3])]


class FailingSteps:
    """The real engine, whose step raises while `failing` is set, as a sampler bug would: no input
    reaches such a bug through the front door any more, so the test injects it."""

    def __init__(self, engine):
        self.engine, self.failing = engine, True

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        if self.failing:
            raise RuntimeError("injected")
        return self.engine.step()


def test_a_failed_step_hands_its_requests_back_and_repeated_failures_exit(core, engine):
    core.engine = FailingSteps(engine)
    dispatch(core, 1, greedy(5))
    dispatch(core, 2, greedy(5))
    core.step()
    assert of_kind(core.ports.scheduler, messages.Failed) == [messages.Failed("RuntimeError: injected", [1, 2])]
    assert not core.active and core.ports.frontend == []   # the scheduler decides what to answer
    for rid in range(3, 2 + MAX_FAILED_STEPS):
        dispatch(core, rid, greedy(5))
        if rid < 1 + MAX_FAILED_STEPS:
            core.step()
    with pytest.raises(SystemExit, match=f"{MAX_FAILED_STEPS} engine steps failed in a row"):
        core.step()
    core.engine.failing = False
    run_until_idle(core)


def test_a_good_step_resets_the_failure_count(core, engine):
    core.engine = FailingSteps(engine)
    for rid in range(MAX_FAILED_STEPS * 2):
        dispatch(core, rid, greedy(1))
        core.engine.failing = rid % 2 == 0
        core.step()   # never MAX_FAILED_STEPS in a row
    core.engine.failing = False
    run_until_idle(core)
    assert len(of_kind(core.ports.scheduler, messages.Failed)) == MAX_FAILED_STEPS


def test_hello_and_stats_name_the_worker_and_its_engine(core, engine):
    hello = core.hello()
    assert (hello.index, hello.device, hello.model) == (3, "cpu", engine.model_name)
    assert (hello.served_model, hello.version) == ("default", "default")   # [model] alone: the one-model table
    stats = core.stats()   # typed: every figure of the engine is declared in WorkerStats, or this raises
    assert (stats.index, stats.model, stats.running, stats.kv_blocks_total) == \
        (3, engine.model_name, 0, engine.stats()["kv_blocks_total"])
    assert set(engine.stats()) <= set(WorkerStats.__struct_fields__)


def steps_of(engine) -> int:
    return engine.stats()["steps"]


def test_prompts_returning_from_a_step_wait_for_each_other_up_to_that_steps_time(core, engine):
    for rid in (1, 2, 3):   # a closed loop's clients, answered together
        dispatch(core, rid, greedy(1))
    core.step()
    core.flush_done()   # as the worker's loop does after each step: the engine is idle, the note goes
    assert len(engine.last_batch) == 3 and not core.has_work
    dispatch(core, 4, greedy(1))   # the first to come back does not run alone
    before = steps_of(engine)
    core.step()
    assert steps_of(engine) == before
    bound_ms = min(engine.last_step_s, CONFIG.engine.gather_max_ms / 1000) * 1000   # the last step's time
    assert core.poll_timeout_ms(100) == pytest.approx(bound_ms)
    core.clock.now += bound_ms / 2000
    assert core.poll_timeout_ms(100) == pytest.approx(bound_ms / 2)
    dispatch(core, 5, greedy(1))
    dispatch(core, 6, greedy(1))
    core.step()   # all three came: one step
    assert steps_of(engine) == before + 1 and sorted(s.key for s, _ in engine.last_batch) == [4, 5, 6]
    assert len(replies(core.ports.frontend, messages.Final)) == 6


def test_a_wait_runs_out_lowers_the_peak_and_a_late_prompt_or_one_beside_a_decode_never_waits(core, engine):
    for rid in (1, 2, 3):
        dispatch(core, rid, greedy(1))
    core.step()
    dispatch(core, 4, greedy(1))
    core.step()
    assert core.has_work   # waiting for the other two
    bound_s = min(engine.last_step_s, CONFIG.engine.gather_max_ms / 1000)
    core.clock.now += bound_s   # they did not come: it runs alone, and the peak is now 1
    core.step()
    assert [s.key for s, _ in engine.last_batch] == [4] and not core.has_work
    dispatch(core, 5, greedy(1))
    assert core.poll_timeout_ms(100) == 0
    core.step()
    assert [s.key for s, _ in engine.last_batch] == [5]
    for rid in (6, 7):   # the peak is 2 again
        dispatch(core, rid, greedy(1))
    core.step()
    core.clock.now += 1.0   # a prompt long after the last step is nobody's return: it runs at once
    dispatch(core, 8, greedy(1))
    core.step()
    assert [s.key for s, _ in engine.last_batch] == [8] and not core.has_work
    dispatch(core, 9, greedy(4))
    core.clock.now += 1.0
    core.step()   # 9 runs alone (it came late) and keeps decoding
    dispatch(core, 10, greedy(1))
    assert core.poll_timeout_ms(100) == 0
    core.step()   # a decode runs anyway: the prompt joins it
    assert sorted(s.key for s, _ in engine.last_batch) == [9, 10]
    run_until_idle(core)


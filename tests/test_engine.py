"""The engine on the embedded model: sampling, stopping, streaming text, KV accounting, limits."""
import json

import msgspec

import pytest
import torch

from mcpd.config import Config, EngineConfig, ModelConfig, WorkersConfig
from mcpd.engine import Engine, SamplingParams
from mcpd.engine.engine import StepOutput
from mcpd.models import load_model
from mcpd.models.layers import AttentionMetadata, bind_kv_cache
from kernel_sets import NATIVE_SETS

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
UNTUNED = WorkersConfig(adaptive_threads=False)   # no thread trial holds a burst back: step counts are exact


def make_engine(workers: WorkersConfig | None = None, **engine) -> Engine:
    engine.setdefault("pool_bytes", 16 << 20)
    return Engine(Config(model=ModelConfig(max_model_len=512), engine=EngineConfig(**engine),
                         workers=workers or WorkersConfig()), CPU)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def run(engine: Engine, requests: dict) -> dict:
    """requests: key -> (prompt text, params). Returns key -> list of StepOutputs, all run together."""
    for key, (prompt, params) in requests.items():
        engine.add_request(key, engine.tokenizer.encode(prompt), params)
    outputs = {key: [] for key in requests}
    while engine.has_work:
        for out in engine.step():
            outputs[out.key].append(out)
    return outputs


def tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def text(outputs) -> str:
    return "".join(out.text for out in outputs)


def test_embedded_model_generates_deterministically(engine):
    first = run(engine, {"a": ("Hello, mcpd", GREEDY)})["a"]
    again = run(make_engine(), {"a": ("Hello, mcpd", GREEDY)})["a"]
    assert tokens(first) == tokens(again) and len(tokens(first)) == 24
    assert first[-1].finished and first[-1].finish_reason == "length"
    assert (first[-1].prompt_tokens, first[-1].completion_tokens) == (12, 24)
    assert all(not out.finished for out in first[:-1])


def test_seeded_sampling_ignores_batch_composition(engine):
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    alone = tokens(run(engine, {"x": ("same prompt", seeded)})["x"])
    crowd = run(engine, {
        "other": ("a different, longer prompt that prefills alongside", SamplingParams(max_tokens=30, seed=7)),
        "x": ("same prompt", seeded),
        "greedy": ("greedy neighbour", GREEDY),
        "unseeded": ("no seed here", SamplingParams(max_tokens=5)),
    })
    assert tokens(crowd["x"]) == alone
    other_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=4321)
    assert tokens(run(engine, {"y": ("same prompt", other_seed)})["y"]) != alone


def test_top_k_1_equals_greedy(engine):
    outputs = run(engine, {"greedy": ("top k", GREEDY),
                           "top1": ("top k", SamplingParams(max_tokens=24, top_k=1, ignore_eos=True))})
    assert tokens(outputs["top1"]) == tokens(outputs["greedy"])


def test_stop_string_ends_the_text_before_it(engine):
    reference = text(run(engine, {"r": ("stop strings", GREEDY)})["r"])
    stop = reference[6:8]
    cut = reference.index(stop)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=("never appears", stop))
    outputs = run(engine, {"s": ("stop strings", params)})["s"]
    assert text(outputs) == reference[:cut]
    assert outputs[-1].finish_reason == "stop"
    assert all(stop not in out.text for out in outputs)


def test_stop_token_id_stops_and_is_not_text(engine):
    reference = tokens(run(engine, {"r": ("stop tokens", GREEDY)})["r"])
    stop_token = reference[3]
    first = reference.index(stop_token)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(stop_token,))
    outputs = run(engine, {"s": ("stop tokens", params)})["s"]
    assert tokens(outputs) == reference[:first + 1]
    assert outputs[-1].finish_reason == "stop"
    assert text(outputs) == engine.tokenizer.decode(reference[:first])


def test_text_deltas_add_up_to_the_decoded_tokens(engine):
    # Sampled bytes from a random model: plenty of broken and multi-byte UTF-8 to withhold.
    requests = {i: (f"prompt {i}", SamplingParams(max_tokens=40, seed=i, ignore_eos=True)) for i in range(6)}
    for outputs in run(engine, requests).values():
        assert text(outputs) == engine.tokenizer.decode(tokens(outputs))
        assert all(not out.text.endswith("\ufffd") for out in outputs[:-1])


def test_eos_finishes_with_stop(engine):
    eos = engine.tokenizer.EOS
    for seed in range(50):  # sample until some request draws EOS (about 1 in 258 tokens)
        outputs = run(engine, {"e": ("eos", SamplingParams(max_tokens=200, temperature=1.5, seed=seed))})["e"]
        if outputs[-1].finish_reason == "stop":
            assert tokens(outputs)[-1] == eos and eos not in tokens(outputs)[:-1]
            return
    pytest.fail("no sampled request ever reached EOS")


def test_greedy_logprobs_match_the_model(engine):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    prompt = engine.tokenizer.encode("log probabilities")
    engine.add_request("lp", prompt, params)
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    generated, logprobs = tokens(outputs), [lp for out in outputs for lp in out.logprobs]
    # One fresh forward over prompt + generated tokens, by the same (seeded) model in a scratch cache.
    model, sequence = load_model(ModelConfig(), CPU).model, prompt + generated
    bind_kv_cache(model, torch.zeros(8, model.num_layers, 2, 16, model.num_kv_heads, model.head_dim))
    attn = AttentionMetadata.build([list(range(8))], [0], [len(sequence)], 16, CPU)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(sequence), attn.positions, attn))
    expected = logits[len(prompt) - 1:-1].log_softmax(-1).gather(1, torch.tensor(generated)[:, None]).squeeze(1)
    assert all(lp <= 0 for lp in logprobs)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=1e-4)
    assert generated == logits[len(prompt) - 1:-1].argmax(-1).tolist()


def test_sampled_logprobs_are_log_probabilities(engine):
    params = SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=3, logprobs=True, ignore_eos=True)
    outputs = run(engine, {"s": ("sampled", params)})["s"]
    logprobs = [lp for out in outputs for lp in out.logprobs]
    assert len(logprobs) == 12 and all(lp <= 0 for lp in logprobs)
    # Only 20 tokens are allowed, so each chosen one has at least the least likely share of them.
    assert all(lp > -50 for lp in logprobs)


def test_abort_frees_blocks_at_once_and_reports(engine):
    engine.add_request("long", engine.tokenizer.encode("x" * 100), SamplingParams(max_tokens=300))
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort("long")
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["running"] == 0
    assert not engine.abort("long")
    [out] = engine.step()
    assert (out.key, out.finished, out.finish_reason, out.token_ids) == ("long", True, "abort", [])
    assert not engine.has_work and engine.step() == []


def test_kv_waste_is_within_each_last_block():
    engine = make_engine(kv_block_size=16)
    for i, length in enumerate([1, 15, 16, 17, 40, 100]):  # different tokens: no shared prefix
        engine.add_request(i, [65 + i] * length, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(7):
        engine.step()
        stats = engine.stats()
        slots = stats["kv_blocks_used"] * stats["kv_block_size"]
        computed = sum(s.num_computed for s in engine.scheduler.running)
        assert stats["kv_waste_frac"] == pytest.approx((slots - computed) / slots)
        assert slots - computed <= stats["running"] * (stats["kv_block_size"] - 1)
    assert stats["kv_waste_frac"] < 0.3  # 6 sequences of ~60 tokens: under one block each


@pytest.mark.parametrize("kernels", ["auto", *NATIVE_SETS])
def test_pool_exhaustion_preempts_and_every_request_finishes(engine, kernels):
    """Batched and preempted, on the default kernels and each native set: the tokens of the
    default kernels with room for all."""
    prompts = {i: (f"request number {i:02d} of 8", GREEDY) for i in range(8)}
    expected = {key: tokens(outs) for key, outs in run(engine, prompts).items()}
    # 8 blocks of 16 tokens. Each request's 25-token prompt takes 2 blocks, so four are admitted and
    # fill the cache; then each needs a third block for its 24 generated tokens.
    small = make_engine(pool_bytes=1 << 20, kv_fraction=0.5, kernels=kernels)
    assert small.kv.num_blocks == 8
    outputs = run(small, prompts)
    assert {key: tokens(outs) for key, outs in outputs.items()} == expected
    assert small.stats()["preemptions"] > 0 and small.stats()["kv_blocks_used"] == 0


def test_preemption_picks_the_lowest_priority_even_if_older():
    small = make_engine(pool_bytes=1 << 20, kv_fraction=0.5)  # 8 blocks; each request grows to 7
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    small.add_request("low", [65] * 40, params, priority=0)
    small.add_request("high", [66] * 40, params, priority=5)
    steps_with_output = {"low": [], "high": []}
    step = 0
    while small.has_work:
        step += 1
        for out in small.step():   # each token's step: alone, low may take several a step (decode_burst)
            steps_with_output[out.key] += [step] * len(out.token_ids)
    high, low = steps_with_output["high"], steps_with_output["low"]
    assert small.stats()["preemptions"] > 0
    assert high == list(range(1, 61))  # a token every step: never preempted
    assert len(low) == 60 and low[-1] > high[-1]


@pytest.mark.parametrize("kernels", ["auto", *NATIVE_SETS])
def test_chunked_prefill_and_garbage_in_fresh_kv_memory_change_nothing(engine, kernels):
    prompt = "a prompt long enough to take several sixteen token chunks to prefill " * 3
    expected = tokens(run(engine, {"p": (prompt, GREEDY)})["p"])
    chunked = make_engine(max_step_tokens=16, kernels=kernels)
    chunked.kv.tensor.fill_(float("nan"))  # the pool hands out uninitialised memory
    prompt_ids = chunked.tokenizer.encode(prompt)
    chunked.add_request("p", prompt_ids, GREEDY)
    outputs, prefill_steps = chunked.step(), 1
    while not outputs:   # nothing comes out until the prompt's last chunk has run
        outputs, prefill_steps = chunked.step(), prefill_steps + 1
    while chunked.has_work:
        outputs += chunked.step()
    assert prefill_steps == -(-len(prompt_ids) // 16)   # chunks of max_step_tokens
    assert tokens(outputs) == expected


def test_requests_that_cannot_run_are_refused(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [65] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match=r"\[0, 258\)"):
        engine.add_request("vocab", [65, 999], GREEDY)
    small = make_engine(pool_bytes=1 << 20, kv_fraction=0.5)  # 8 blocks = 128 tokens
    with pytest.raises(ValueError, match="never fit the KV cache"):
        small.add_request("big", [65] * 100, SamplingParams(max_tokens=100))
    engine.add_request("dup", [65], GREEDY)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [65], GREEDY)
    engine.abort("dup")
    engine.step()


@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_a_tiny_temperature_acts_as_greedy_with_finite_logprobs(engine, temperature):
    params = SamplingParams(max_tokens=12, temperature=temperature, logprobs=True, ignore_eos=True)
    outputs = run(engine, {"t": ("tiny", params)})["t"]
    assert tokens(outputs) == tokens(run(engine, {"g": ("tiny", GREEDY)})["g"])[:12]
    assert all(lp == 0.0 for out in outputs for lp in out.logprobs)


def test_hostile_but_accepted_params_run_beside_others_unaffected(engine):
    """Extreme values the engine accepts: each request completes and its neighbours' tokens are
    those they get alone (top_k beyond int64 is off; a temperature below 1e-38 acts as greedy
    with finite logprobs; the extreme seeds of msgpack's range)."""
    neighbours = {"greedy": ("greedy neighbour", GREEDY),
                  "seeded": ("seeded neighbour", SamplingParams(max_tokens=24, temperature=0.8, seed=5,
                                                                ignore_eos=True))}
    hostile = {
        "top_k": ("huge top_k", SamplingParams(max_tokens=24, top_k=(1 << 64) - 1, seed=1, ignore_eos=True)),
        "cold": ("tiny temperature", SamplingParams(max_tokens=24, temperature=1e-45, top_p=0.5,
                                                    logprobs=True, ignore_eos=True)),
        "seed_max": ("huge seed", SamplingParams(max_tokens=24, seed=(1 << 64) - 1, ignore_eos=True)),
        "seed_min": ("negative seed", SamplingParams(max_tokens=24, seed=-(1 << 63), top_k=5, ignore_eos=True)),
    }
    alone = {key: tokens(run(engine, {key: request})[key]) for key, request in neighbours.items()}
    together = run(engine, {**neighbours, **hostile})
    assert {key: tokens(together[key]) for key in neighbours} == alone
    assert all(len(tokens(together[key])) == 24 for key in hostile)
    cold = together["cold"]
    assert tokens(cold) == tokens(run(engine, {"g": ("tiny temperature", GREEDY)})["g"])
    assert all(lp == 0.0 for out in cold for lp in out.logprobs)


def test_stats_are_plain_json(engine):
    stats = json.loads(msgspec.json.encode(engine.stats()))   # the pool's figures as their struct's map
    assert stats["model"] == "mcpd-embedded-llama" and stats["dtype"] == "float32"
    assert stats["pool"]["total_bytes"] == 16 << 20
    assert stats["kv_blocks_total"] * 64 * 1024 <= stats["pool"]["in_use_bytes"]
    assert 0 <= stats["pool"]["external_fragmentation"] <= 1


def test_kv_cache_gets_kv_fraction_of_a_pool_that_is_not_a_power_of_two():
    import torch
    from mcpd.config import from_dict
    from mcpd.engine import Engine
    engine = Engine(from_dict({"engine": {"pool_bytes": 96 << 20, "kv_fraction": 0.9}}), torch.device("cpu"))
    assert engine.kv.tensor.numel() * engine.kv.tensor.element_size() > 0.85 * (96 << 20)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=45, temperature=0, ignore_eos=True),   # ends mid-burst
    SamplingParams(max_tokens=40, temperature=0),                    # the model's EOS may come mid-burst
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=("e",)),   # a stop string mid-burst
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(101, 32)),
])
@pytest.mark.parametrize("kernels", NATIVE_SETS)
def test_a_lone_greedy_sequence_bursts_to_the_tokens_and_cache_of_single_steps(params, kernels):
    """engine.decode_burst: the native greedy steps choose the tokens, text, finish and cached
    blocks that one step at a time does, in fewer steps."""
    prompt = "the burst must match the steps "
    results = {}
    for burst in (1, 8):
        engine = make_engine(kernels=kernels, decode_burst=burst)
        outputs = run(engine, {"r": (prompt, params)})["r"]
        results[burst] = (tokens(outputs), text(outputs), outputs[-1].finish_reason, dict(engine.kv.cached),
                          engine.stats()["steps"])
    assert results[8][:4] == results[1][:4]
    assert results[8][4] < results[1][4]


@pytest.mark.parametrize("cached_blocks", [0, 1])
@pytest.mark.parametrize("kernels", NATIVE_SETS)
def test_a_lone_prompt_token_runs_as_one_native_greedy_step(cached_blocks, kernels):
    """A lone greedy prompt with one token left to run (a 1-token prompt, or the one its cached
    prefix leaves) runs through the native greedy call, not the step's Python forward: the same
    tokens, text, cached blocks and counts as the Python step, its first token out alone."""
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    results = {}
    for burst in (1, 8):
        engine = make_engine(kernels=kernels, decode_burst=burst)
        prompt = engine.tokenizer.encode("the cache holds all of this prompt but its last token")
        prompt = prompt[:cached_blocks * engine.kv.block_size + 1]
        engine.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while engine.has_work:
            engine.step()
        forward, forwards = engine.model.forward, []
        engine.model.forward = lambda *args: forwards.append(args) or forward(*args)
        engine.add_request("r", prompt, params)
        outputs = engine.step()
        assert len(forwards) == (1 if burst == 1 else 0)
        assert [len(out.token_ids) for out in outputs] == [1]
        while engine.has_work:
            outputs += engine.step()
        stats = engine.stats()
        results[burst] = (tokens(outputs), text(outputs), outputs[-1].finish_reason, dict(engine.kv.cached),
                          stats["tokens_prefilled"], stats["tokens_generated"], stats["prefix_cache_hits"])
    assert results[8] == results[1]
    assert results[1][0] and results[1][6] == cached_blocks * engine.kv.block_size


@pytest.mark.parametrize("prompt_length", [16, 21])
@pytest.mark.parametrize("kernels", NATIVE_SETS)
def test_bursts_run_across_block_ends_and_cache_the_blocks_they_fill(prompt_length, kernels):
    """A lone greedy sequence's 64 tokens: the prompt's step, then bursts of decode_burst tokens
    wherever the 16-token blocks end. Every token it computed is found by the next request with
    those tokens, which then decodes what an engine without bursts does."""
    def outputs(engine: Engine, prompt: list[int], max_tokens: int) -> list[StepOutput]:
        engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return [out for _ in iter(lambda: engine.has_work, False) for out in engine.step()]

    engine = make_engine(UNTUNED, kernels=kernels, decode_burst=8)
    prompt = list(range(40, 40 + prompt_length))
    first = outputs(engine, prompt, 64)
    assert [len(out.token_ids) for out in first] == [1] + [8] * 7 + [7]
    assert engine.stats()["steps"] == 9
    follow = prompt + tokens(first)
    again = tokens(outputs(engine, follow, 12))
    assert engine.stats()["prefix_cache_hits"] == len(follow) - 1
    assert again == tokens(outputs(make_engine(kernels=kernels, decode_burst=1), follow, 12))


@pytest.mark.parametrize("kernels", NATIVE_SETS)
def test_a_burst_takes_no_more_blocks_than_are_free(kernels):
    """Two tenants' sequences in an 8-block cache, one decode a step (engine.shared_step_decodes):
    a lone step's burst stops at the last slot its blocks and the free ones give (one took the
    last free block), and both sequences generate what one token a step does."""
    results, bursts_to_the_last_block = {}, 0
    for burst in (1, 8):
        engine = make_engine(UNTUNED, pool_bytes=1 << 20, kv_fraction=0.5, shared_step_decodes=1,
                             kernels=kernels, decode_burst=burst)
        assert engine.kv.num_blocks == 8
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for key, token in (("a", 65), ("b", 66)):
            engine.add_request(key, [token] * (45 if key == "a" else 40), params, cache_namespace=key)
        outputs = {"a": [], "b": []}
        while engine.has_work:
            for out in engine.step():
                outputs[out.key].append(out)
                bursts_to_the_last_block += len(out.token_ids) > 1 and engine.kv.num_free == 0
        results[burst] = {key: tokens(outs) for key, outs in outputs.items()}
    assert results[8] == results[1]
    assert bursts_to_the_last_block


@pytest.mark.parametrize("kernels", NATIVE_SETS)
def test_no_burst_while_a_request_waits_or_samples(kernels):
    """Bursts hold a newcomer back and cannot sample: with two requests, or temperature, or
    logprobs, every step is one token of each sequence."""
    engine = make_engine(kernels=kernels, decode_burst=8)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=1)
    with_logprobs = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=True)
    for requests in ({"a": ("one", GREEDY), "b": ("two", GREEDY)}, {"s": ("three", sampled)},
                     {"l": ("four", with_logprobs)}):
        assert all(len(out.token_ids) <= 1 for outs in run(engine, requests).values() for out in outs)


@pytest.mark.parametrize("token, position, table", [(2**63 - 1, 0, [0]), (-1, 0, [0]), (5, 10, [0]), (5, -3, [0]),
                                                     (5, 0, [])])
@pytest.mark.parametrize("kernels", NATIVE_SETS)
def test_greedy_steps_refuse_a_token_or_position_outside_the_model_or_table(token, position, table, kernels):
    model = make_engine(kernels=kernels).model
    with pytest.raises(IndexError, match="outside the model or table"):
        model.greedy_steps(token, position, table, 8, ())

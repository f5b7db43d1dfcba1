"""Automatic prefix caching: shared KV blocks across requests and turns, per namespace, under
pool pressure and preemption, with the same tokens as a cold engine."""
import pytest
import torch

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine, SamplingParams
from kernel_sets import NATIVE_SETS
from tiny_checkpoints import load_hf, make_checkpoint

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)   # computes the prompt only
SYSTEM = [(7 * i + 3) % 250 for i in range(160)]  # ten full blocks of 16 tokens


def make_engine(model_path: str = "", **engine) -> Engine:
    engine.setdefault("pool_bytes", 16 << 20)
    return Engine(Config(model=ModelConfig(path=model_path, max_model_len=512),
                         engine=EngineConfig(**engine)), CPU)


def small_engine() -> Engine:
    engine = make_engine(pool_bytes=1 << 20, kv_fraction=0.5)
    assert engine.kv.num_blocks == 8  # 128 tokens
    return engine


def run(engine: Engine, requests: dict) -> dict[str, list[int]]:
    """requests: key -> (token ids, params[, namespace]), all run together; key -> generated tokens."""
    for key, (prompt, params, *namespace) in requests.items():
        engine.add_request(key, prompt, params, cache_namespace=namespace[0] if namespace else "")
    generated = {key: [] for key in requests}
    while engine.has_work:
        for out in engine.step():
            generated[out.key] += out.token_ids
    return generated


def run_one(engine: Engine, prompt: list[int], params=GREEDY, namespace: str = "") -> tuple[list[int], dict]:
    """Generated tokens, and how prefill and cache counters moved."""
    before = engine.stats()
    tokens = run(engine, {"r": (prompt, params, namespace)})["r"]
    after = engine.stats()
    return tokens, {name: after[name] - before[name]
                    for name in ("tokens_prefilled", "prefix_cache_queries", "prefix_cache_hits")}


def cold(prompt: list[int], params=GREEDY) -> list[int]:
    return run_one(make_engine(), prompt, params)[0]


def test_shared_prefix_prefills_only_the_uncached_suffix():
    engine = make_engine()
    _, first = run_one(engine, SYSTEM + [65, 66, 67])
    assert first == {"tokens_prefilled": 163, "prefix_cache_queries": 163, "prefix_cache_hits": 0}
    second = SYSTEM + [97, 98, 99, 100, 101]
    tokens, moved = run_one(engine, second)
    assert moved == {"tokens_prefilled": 5, "prefix_cache_queries": 165, "prefix_cache_hits": 160}
    assert tokens == cold(second)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_waste_frac"] == 0  # idle cache is not waste
    # The prefix, then one full block and the partial tail of each request.
    assert stats["cached_blocks"] == 10 + 2 * (1 + 1)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    engine = make_engine()
    prompt = SYSTEM[:32]
    first, _ = run_one(engine, prompt)
    again, moved = run_one(engine, prompt)
    # The last token's logits are needed: its block is not shared (it would be written), its other
    # 15 rows are copied into the sequence's own block.
    assert moved["prefix_cache_hits"] == 31 and moved["tokens_prefilled"] == 1
    assert again == first == cold(prompt)


@pytest.mark.slow
def test_next_chat_turn_reuses_the_generated_tokens_too():
    engine = make_engine()
    turn1 = SYSTEM[:50]
    reply, _ = run_one(engine, turn1, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    turn2 = turn1 + reply + [40, 41, 42, 43, 44, 45]
    tokens, moved = run_one(engine, turn2)
    # Every token turn 1 computed (all but its last sampled one) comes from the cache: 80 in
    # shared blocks, 9 copied from turn 1's partial last block.
    assert moved["prefix_cache_hits"] == len(turn1) + len(reply) - 1 == 89
    assert moved["tokens_prefilled"] == len(turn2) - 89
    assert tokens == cold(turn2)


@pytest.mark.slow
def test_namespaces_never_share_blocks():
    engine = make_engine()
    run_one(engine, SYSTEM + [65], namespace="tenant-a")
    prompt = SYSTEM + [66]
    tokens, moved = run_one(engine, prompt, namespace="tenant-b")
    assert moved["prefix_cache_hits"] == 0 and moved["tokens_prefilled"] == len(prompt)
    assert tokens == cold(prompt)
    _, moved = run_one(engine, prompt, namespace="tenant-a")
    assert moved["prefix_cache_hits"] == 160


def test_concurrent_sequences_share_a_system_prompt():
    prompts = {"a": SYSTEM[:64] + [1, 2, 3], "b": SYSTEM[:64] + [4, 5, 6, 7]}

    def first_step(namespaces):
        engine = make_engine()
        for key, namespace in zip(prompts, namespaces):
            engine.add_request(key, prompts[key], GREEDY, cache_namespace=namespace)
        outputs = engine.step()  # both admitted in the same step
        return engine, {out.key: out.token_ids for out in outputs}

    engine, generated = first_step(["same", "same"])
    apart, _ = first_step(["one", "other"])
    assert engine.stats()["kv_blocks_used"] == 4 + 1 + 1 and apart.stats()["kv_blocks_used"] == 5 + 5
    # Waste is unused slots of the blocks held, each counted once: (80 - 67) + (80 - 68) of 96.
    assert engine.stats()["kv_waste_frac"] == pytest.approx(25 / 96)
    assert engine.stats()["prefix_cache_hits"] == 64
    while engine.has_work:
        for out in engine.step():
            generated[out.key] += out.token_ids
    assert generated == {key: cold(prompt) for key, prompt in prompts.items()}


@pytest.mark.slow
def test_pool_pressure_evicts_idle_blocks_and_everything_completes():
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = SYSTEM[:40]
    others = {f"o{i}": (SYSTEM[i:i + 60][::-1], params) for i in range(1, 4)}
    engine = small_engine()
    first_tokens, _ = run_one(engine, first, params)
    assert engine.stats()["cached_blocks"] == 5  # 79 computed tokens: 4 full blocks and a tail
    generated = run(engine, others)  # 7 blocks each, 8 in all: the cache must give blocks back
    assert generated == {key: cold(prompt, params) for key, (prompt, _) in others.items()}
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0
    assert stats["cached_blocks"] <= stats["kv_blocks_total"]
    again, moved = run_one(engine, first, params)
    assert moved["prefix_cache_hits"] == 0 and again == first_tokens  # least recently used: evicted


@pytest.mark.slow
def test_preempting_a_sharer_leaves_the_other_intact():
    # Two sequences share 3 prompt blocks and each grows to 7 blocks: 11 > 8, so the lower
    # priority one is preempted, drops its hold on the shared blocks, and recomputes later.
    prompts = {"greedy": SYSTEM[:48] + [1, 2, 3, 4], "seeded": SYSTEM[:48] + [5, 6, 7, 8]}
    params = {"greedy": SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
              "seeded": SamplingParams(max_tokens=60, temperature=0.8, seed=11, ignore_eos=True)}
    engine = small_engine()
    engine.add_request("greedy", prompts["greedy"], params["greedy"], priority=1)
    engine.add_request("seeded", prompts["seeded"], params["seeded"])
    generated = {key: [] for key in prompts}
    while engine.has_work:
        for out in engine.step():
            generated[out.key] += out.token_ids
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] >= 48
    assert generated == {key: cold(prompts[key], params[key]) for key in prompts}


def hf_greedy(checkpoint, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        return load_hf(checkpoint).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                            do_sample=False, pad_token_id=1)[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("checkpoints") / "llama", "llama")


@pytest.mark.parametrize("kernels", ["auto", *NATIVE_SETS])
def test_cache_hit_matches_transformers(llama, kernels):
    engine = make_engine(str(llama), pool_bytes=4 << 20, kernels=kernels)
    turn1 = [0] + list(range(40, 70))
    reply, _ = run_one(engine, turn1)
    turn2 = turn1 + reply + [5, 6, 7]
    tokens, moved = run_one(engine, turn2)
    assert moved["prefix_cache_hits"] == 50   # 48 in shared blocks, 2 copied from turn 1's tail
    assert tokens == hf_greedy(llama, turn2, 20)


@pytest.mark.slow
def test_a_block_cached_for_a_step_that_never_ran_is_forgotten():
    # x's decode fills its first block, which grow() caches, but later in the same schedule() y
    # needs more blocks than exist beside z: x is preempted, then y itself, and x's step never runs.
    engine = make_engine(pool_bytes=1 << 20, kv_fraction=0.5, max_step_tokens=64)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    requests = {"x": (SYSTEM[140:154], 0), "z": (SYSTEM[100:140], 2), "y": (SYSTEM[:100], 1)}
    engine.add_request("x", requests["x"][0], params)
    generated = {key: [] for key in requests}
    generated["x"] = engine.step()[0].token_ids  # x: prompt, first token
    for key in "zy":
        engine.add_request(key, requests[key][0], params, priority=requests[key][1])
    for _ in range(2):              # x decodes position 14, then (in vain) position 15
        for out in engine.step():
            generated[out.key] += out.token_ids
    x = engine.sequences["x"]
    assert engine.stats()["preemptions"] == 2 and x.num_computed == 0
    assert x.block_hashes[0] not in engine.kv.cached
    while engine.has_work:
        for out in engine.step():
            generated[out.key] += out.token_ids
    assert generated == {key: cold(prompt, params) for key, (prompt, _) in requests.items()}
    follow_up = requests["x"][0] + generated["x"] + [9, 9, 9]
    assert run_one(engine, follow_up)[0] == cold(follow_up)


def test_blocks_shared_in_the_step_their_owner_is_preempted_are_still_computed():
    # a prefills SYSTEM[:80] in chunks of 48. In its second step grow() caches blocks 3 and 4,
    # which b (sharing all five) is admitted onto in the same step; then c, more important than
    # a, takes a's seat (max_num_seqs=2): a is preempted before the model runs. Blocks 3 and 4
    # must still be computed this step (by b), not dropped from the cache while b holds them.
    engine = make_engine(max_num_seqs=2, max_step_tokens=48)
    requests = {"a": (SYSTEM[:80], 0), "b": (SYSTEM[:80] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2),
                "c": (SYSTEM[100:104], 1)}
    engine.add_request("a", requests["a"][0], GREEDY, priority=0)
    assert engine.step() == [] and engine.sequences["a"].num_computed == 48
    for key in "bc":
        engine.add_request(key, requests[key][0], GREEDY, priority=requests[key][1])
    generated = {key: [] for key in requests}
    while engine.has_work:
        for out in engine.step():
            generated[out.key] += out.token_ids
    assert engine.stats()["preemptions"] == 1
    assert generated == {key: cold(prompt) for key, (prompt, _) in requests.items()}
    # A later request reusing b's blocks reads keys and values that were computed.
    follow_up = requests["b"][0] + generated["b"][:5]
    assert run_one(engine, follow_up)[0] == cold(follow_up)


def test_a_repeated_two_token_prompt_prefills_one_row():
    # One request's partial last block stays cached when it finishes; the next with the same first
    # token copies that row and runs only its last token, as llama.cpp's slot reuse does.
    engine = make_engine()
    prompt = [256, 72]
    first, moved = run_one(engine, prompt, ONE)
    assert moved["tokens_prefilled"] == 2
    again, moved = run_one(engine, prompt, ONE)
    assert moved == {"tokens_prefilled": 1, "prefix_cache_queries": 2, "prefix_cache_hits": 1}
    assert again == first == cold(prompt, ONE)


def test_a_batch_copies_rows_from_a_tail_and_from_a_cached_full_block():
    engine = make_engine()
    run_one(engine, SYSTEM[:41], ONE)   # blocks 0 and 1 full and cached, then a tail of 9 rows
    prompts = {"in-tail": SYSTEM[:37] + [9], "past-tail": SYSTEM[:41] + [1, 2],
               "in-full-block": SYSTEM[:20] + [5, 6], "twice": SYSTEM[:36], "again": SYSTEM[:36]}
    before = engine.stats()
    generated = run(engine, {key: (prompt, GREEDY) for key, prompt in prompts.items()})
    after = engine.stats()
    # Shared blocks, then rows copied: 5 of the tail to "in-tail" (its 6th token differs), all 9 to
    # "past-tail", 4 of block 1 to "in-full-block"; "twice" and "again" copy 3 of the tail each.
    hits = {"in-tail": 32 + 5, "past-tail": 32 + 9, "in-full-block": 16 + 4, "twice": 32 + 3, "again": 32 + 3}
    assert sum(len(prompts[key]) - hit for key, hit in hits.items()) == 1 + 2 + 2 + 1 + 1
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == sum(hits.values())
    assert (after["tokens_prefilled"] - before["tokens_prefilled"]
            == sum(len(prompts[key]) - hit for key, hit in hits.items()))
    assert generated == {key: cold(prompt) for key, prompt in prompts.items()}


def test_a_tail_handed_out_as_the_block_it_is_copied_into():
    # The prompt fills the 8-block cache: its 7 full blocks and its tail are all that is idle, and
    # the resend shares the 7, so the one block it needs is the tail, its own source.
    engine = small_engine()
    prompt = SYSTEM[:120]
    first, _ = run_one(engine, prompt, ONE)
    assert engine.stats()["cached_blocks"] == 8
    again, moved = run_one(engine, prompt, ONE)
    assert moved["prefix_cache_hits"] == 119 and moved["tokens_prefilled"] == 1
    assert again == first == cold(prompt, ONE)


def test_chunked_prefill_after_copied_rows():
    engine = make_engine(max_step_tokens=16)
    run_one(engine, SYSTEM[:39], ONE)   # a tail of 7 rows in block 2
    prompt = SYSTEM[:36] + [(5 * i) % 250 for i in range(40)]
    tokens, moved = run_one(engine, prompt)
    assert moved["prefix_cache_hits"] == 32 + 4 and moved["tokens_prefilled"] == len(prompt) - 36
    assert tokens == cold(prompt)


@pytest.mark.parametrize("kernels", ["auto", *NATIVE_SETS])
def test_copied_rows_match_transformers_alone_and_batched(llama, kernels):
    engine = make_engine(str(llama), pool_bytes=4 << 20, kernels=kernels)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    run_one(engine, [0, 42, 43, 44], ONE)   # a tail of 4 rows
    prompts = {"alone": [0, 42, 43, 44]}
    batch = {"short": [0, 42], "longer": [0, 42, 43, 9, 10], "past": [0, 42, 43, 44, 45, 46, 8]}
    for group in (prompts, batch):
        before = engine.stats()["tokens_prefilled"]
        generated = run(engine, {key: (prompt, params) for key, prompt in group.items()})
        copied = {"alone": 3, "short": 1, "longer": 3, "past": 4}
        assert engine.stats()["tokens_prefilled"] - before == sum(len(p) - copied[k] for k, p in group.items())
        assert generated == {key: hf_greedy(llama, prompt, 4) for key, prompt in group.items()}

"""mcpd's models against transformers on tiny random checkpoints: same greedy tokens, same logits,
with each set of kernels (torch's ops, and the native CPU kernels for the Llama family), in
float32 and in bfloat16."""
import json
import shutil

import pytest
import torch

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine, SamplingParams
from mcpd.models import UnsupportedModel, load_model
from mcpd.models.layers import AttentionMetadata, bind_kv_cache
from kernel_sets import NATIVE_SETS
from tiny_checkpoints import KINDS, VARIANTS, VOCAB_SIZE, load_hf, make_checkpoint

CPU = torch.device("cpu")
LLAMAS = tuple(kind for kind in KINDS if kind != "gpt2")
# The variants the native kernels run too; the others' features only torch's ops have.
NATIVE_VARIANTS = ("qwen2_untied", "llama_tied", "llama_linear", "qwen2_yarn", "phi3_plain")
# (kind, kernels): every model on torch's ops; the Llama family on each native set the CPU runs too.
CASES = ([(kind, "torch") for kind in (*KINDS, *VARIANTS)]
         + [(kind, native) for native in NATIVE_SETS for kind in (*LLAMAS, *NATIVE_VARIANTS)])
# The last prompt is longer than the native stack's reused scratch (native_stack.REUSED_SCRATCH_ROWS):
# its prefill takes a fresh one, the decodes after it the reused one.
PROMPTS = [[0, 5, 9, 20, 33], [0, 17], list(range(40, 77)), [0, 300, 2, 150, 150, 9, 64, 8, 7, 6, 5],
           [0] + [(7 * i) % 290 + 3 for i in range(69)]]
MAX_TOKENS = [12, 30, 7, 20, 6]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: make_checkpoint(root / kind, kind) for kind in (*KINDS, *VARIANTS)}


@pytest.fixture(scope="module")
def references(checkpoints):
    """transformers' greedy continuation of every prompt, per checkpoint."""
    out = {}
    for kind, path in checkpoints.items():
        out[kind] = _hf_greedy(load_hf(path), PROMPTS, MAX_TOKENS)
    return out


@pytest.fixture(scope="module")
def references_bf16(checkpoints):
    """transformers' greedy continuations in bfloat16, and its logits at every step."""
    return {kind: _hf_greedy(load_hf(checkpoints[kind], torch.bfloat16), PROMPTS, MAX_TOKENS, scores=True)
            for kind in LLAMAS}


def _hf_greedy(model, prompts, max_tokens, scores=False):
    outputs, logits = [], []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])  # an explicit mask: else generate() takes id 0 for padding
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=1, output_scores=scores, return_dict_in_generate=True)
            outputs.append(out.sequences[0, len(prompt):].tolist())
            logits.append([step[0].float() for step in out.scores or ()])
    return (outputs, logits) if scores else outputs


def make_engine(path, dtype="auto", kernels="auto", device=CPU, **engine) -> Engine:
    engine.setdefault("pool_bytes", 4 << 20)
    engine["kernels"] = kernels
    config = Config(model=ModelConfig(path=str(path), dtype=dtype, max_model_len=128),
                    engine=EngineConfig(**engine))
    return Engine(config, device)


def generate(engine: Engine, prompts, max_tokens) -> list[list[int]]:
    """Run all prompts together, greedy, to completion; return each one's tokens."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(i, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    tokens = {i: [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            tokens[out.key] += out.token_ids
    return [tokens[i] for i in range(len(prompts))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_greedy_tokens_on_a_gpu_match_transformers_on_the_cpu(kind, kernels, checkpoints, references):
    """float32 on the GPU against the CPU reference: auto runs the Llama family on the CUDA kernels
    (decode attention in Triton) with CUDA graphs, torch on torch's ops eagerly (TF32 off as
    torch's default either way); alone and batched."""
    engine = make_engine(checkpoints[kind], dtype="float32", kernels=kernels, device=torch.device("cuda"))
    in_place = kernels == "auto" and kind != "gpt2"
    assert engine.stats()["kernels"] == ("cuda" if in_place else "torch")
    assert (engine.decode_graphs is not None) == in_place and engine.stats()["device"].startswith("cuda")
    assert generate(engine, PROMPTS, MAX_TOKENS) == references[kind]
    for prompt, n, expected in zip(PROMPTS, MAX_TOKENS, references[kind]):
        assert generate(engine, [prompt], [n]) == [expected]


@pytest.mark.parametrize("kind, kernels", CASES)
def test_greedy_tokens_match_transformers_batched_and_alone(kind, kernels, checkpoints, references):
    engine = make_engine(checkpoints[kind], kernels=kernels)
    assert engine.stats()["kernels"] == kernels
    assert generate(engine, PROMPTS, MAX_TOKENS) == references[kind]
    for prompt, n, expected in zip(PROMPTS, MAX_TOKENS, references[kind]):
        assert generate(engine, [prompt], [n]) == [expected]


@pytest.mark.parametrize("kind, kernels", CASES)
def test_prompt_logits_match_transformers(kind, kernels, checkpoints):
    """Every position's logits, for two sequences in one batch, one of them prefilled in two chunks."""
    loaded = load_model(ModelConfig(path=str(checkpoints[kind]), max_model_len=128), CPU)
    model, block_size = loaded.model, 4
    model.use_kernels(kernels)
    bind_kv_cache(model, torch.zeros(16, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim))
    a, b = PROMPTS[2], PROMPTS[3]
    tables = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    with torch.inference_mode():
        # Step 1: all of a, the first 6 tokens of b. Step 2: the rest of b, attending to step 1's KV.
        step1 = _forward(model, [a, b[:6]], tables, [0, 0], block_size)
        step2 = _forward(model, [b[6:]], tables[1:], [6], block_size)
        mine_a, mine_b = step1[:len(a)], torch.cat([step1[len(a):], step2])
        hf = load_hf(checkpoints[kind])
        for prompt, mine in ((a, mine_a), (b, mine_b)):
            expected = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(mine, expected, atol=1e-4, rtol=1e-4)


def _forward(model, chunks, tables, starts, block_size):
    attn = AttentionMetadata.build(tables, starts, [len(c) for c in chunks], block_size, CPU)
    hidden = model(torch.tensor([t for c in chunks for t in c]), attn.positions, attn)
    return model.compute_logits(hidden)


@pytest.mark.parametrize("kind, kernels", [("llama", native) for native in NATIVE_SETS] + [("llama", "torch"),
                                                                                          ("gpt2", "torch")])
def test_preemption_keeps_greedy_tokens(kind, kernels, checkpoints, references):
    # Shrink the cache to 6 blocks (96 tokens): the four requests need 10 blocks together.
    block_bytes = make_engine(checkpoints[kind]).kv.tensor[0].nbytes
    engine = make_engine(checkpoints[kind], kernels=kernels, pool_bytes=1 << 20,
                         kv_fraction=6.5 * block_bytes / (1 << 20))
    assert engine.kv.num_blocks == 6
    assert generate(engine, PROMPTS, MAX_TOKENS) == references[kind]
    assert engine.stats()["preemptions"] > 0


@pytest.mark.parametrize("kernels", [*NATIVE_SETS, "torch"])
def test_chunked_prefill_keeps_greedy_tokens(kernels, checkpoints, references):
    engine = make_engine(checkpoints["qwen2"], kernels=kernels, max_step_tokens=16, kv_block_size=16)
    assert generate(engine, PROMPTS, MAX_TOKENS) == references["qwen2"]


def test_sharded_checkpoint_loads(tmp_path, references):
    path = make_checkpoint(tmp_path / "sharded", "llama", max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    assert generate(make_engine(path), PROMPTS, MAX_TOKENS) == references["llama"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_checkpoint_runs_in_float32_on_cpu(tmp_path, dtype):
    path = make_checkpoint(tmp_path / "half", "qwen2", dtype=dtype)
    engine = make_engine(path)
    assert engine.stats()["dtype"] == "float32"
    # transformers, upcasting the same rounded weights, is the reference.
    assert generate(engine, PROMPTS, MAX_TOKENS) == _hf_greedy(load_hf(path), PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("kind, kernels", [case for case in CASES if case[0] in LLAMAS])
def test_bfloat16_greedy_tokens_match_transformers_in_bfloat16(kind, kernels, checkpoints, references_bf16):
    """bfloat16 logits are coarse (8 bits), so two tokens can tie, and which of two equal or
    one-step-apart logits wins depends on rounding deep inside the matrix products (transformers
    itself picks differently between its prefill and its cached decode). Tokens must equal
    transformers' up to the first such tie; there mcpd's token must be within two bfloat16 steps
    of transformers' best logit, and that sequence's comparison ends."""
    engine = make_engine(checkpoints[kind], dtype="bfloat16", kernels=kernels)
    assert engine.stats()["dtype"] == "bfloat16" and engine.kv.tensor.dtype == torch.bfloat16
    expected, logits = references_bf16[kind]
    for mine in (generate(engine, PROMPTS, MAX_TOKENS),
                 [generate(engine, [p], [n])[0] for p, n in zip(PROMPTS, MAX_TOKENS)]):
        compared = sum(_agree_until_a_tie(*seq) for seq in zip(mine, expected, logits))
        assert compared >= sum(MAX_TOKENS) // 2


def _agree_until_a_tie(mine: list[int], expected: list[int], logits: list[torch.Tensor]) -> int:
    """Tokens that agree before the first difference, which must be a near-tie (see above)."""
    for i, (token, reference) in enumerate(zip(mine, expected)):
        if token != reference:
            best = logits[i].max()
            step = 2.0 ** (torch.floor(torch.log2(best.abs())) - 7)   # bfloat16's spacing at best
            assert best - logits[i][token] <= 2 * step, f"token {i}: {token}, transformers {reference}"
            return i
    return len(mine)


def _edited_copy(source, tmp_path, **changes):
    path = tmp_path / "edited"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes, named", [
    ({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
    ({"rope_parameters": {"rope_type": "proportional", "factor": 4.0, "rope_theta": 10000.0}}, "proportional"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "awq"}}, "awq"),
])
def test_unsupported_models_are_named(checkpoints, tmp_path, changes, named):
    with pytest.raises(UnsupportedModel, match=named):
        make_engine(_edited_copy(checkpoints["llama"], tmp_path, **changes))


def test_missing_weight_is_named(checkpoints, tmp_path):
    path = _edited_copy(checkpoints["llama"], tmp_path, num_hidden_layers=3)
    with pytest.raises(UnsupportedModel, match="layers.2"):
        make_engine(path)


def test_gpt2_max_model_len_is_capped_by_its_positions(checkpoints):
    engine = Engine(Config(model=ModelConfig(path=str(checkpoints["gpt2"]), max_model_len=4096),
                           engine=EngineConfig(pool_bytes=4 << 20)), CPU)
    assert engine.max_model_len == 128  # n_positions
    assert engine.vocab_size == VOCAB_SIZE

"""mcpd's models against transformers on tiny random checkpoints: same greedy tokens, same logits."""
import json
import shutil

import pytest
import torch

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine, SamplingParams
from mcpd.models import UnsupportedModel, load_model
from mcpd.models.layers import AttentionMetadata, bind_kv_cache
from tiny_checkpoints import KINDS, VOCAB_SIZE, load_hf, make_checkpoint

CPU = torch.device("cpu")
PROMPTS = [[0, 5, 9, 20, 33], [0, 17], list(range(40, 77)), [0, 300, 2, 150, 150, 9, 64, 8, 7, 6, 5]]
MAX_TOKENS = [12, 30, 7, 20]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: make_checkpoint(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def references(checkpoints):
    """transformers' greedy continuation of every prompt, per checkpoint."""
    out = {}
    for kind, path in checkpoints.items():
        out[kind] = _hf_greedy(load_hf(path), PROMPTS, MAX_TOKENS)
    return out


def _hf_greedy(model, prompts, max_tokens):
    outputs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])  # an explicit mask: else generate() takes id 0 for padding
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=1)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def make_engine(path, dtype="auto", **engine) -> Engine:
    engine.setdefault("pool_bytes", 4 << 20)
    config = Config(model=ModelConfig(path=str(path), dtype=dtype, max_model_len=128),
                    engine=EngineConfig(**engine))
    return Engine(config, CPU)


def generate(engine: Engine, prompts, max_tokens) -> list[list[int]]:
    """Run all prompts together, greedy, to completion; return each one's tokens."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(i, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    tokens = {i: [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            tokens[out.key] += out.token_ids
    return [tokens[i] for i in range(len(prompts))]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers_batched_and_alone(kind, checkpoints, references):
    engine = make_engine(checkpoints[kind])
    assert generate(engine, PROMPTS, MAX_TOKENS) == references[kind]
    for prompt, n, expected in zip(PROMPTS, MAX_TOKENS, references[kind]):
        assert generate(engine, [prompt], [n]) == [expected]


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_logits_match_transformers(kind, checkpoints):
    """Every position's logits, for two sequences in one batch, one of them prefilled in two chunks."""
    loaded = load_model(ModelConfig(path=str(checkpoints[kind]), max_model_len=128), CPU)
    model, block_size = loaded.model, 4
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


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_preemption_keeps_greedy_tokens(kind, checkpoints, references):
    # Shrink the cache to 6 blocks (96 tokens): the four requests need 10 blocks together.
    block_bytes = make_engine(checkpoints[kind]).kv.tensor[0].nbytes
    engine = make_engine(checkpoints[kind], pool_bytes=1 << 20, kv_fraction=6.5 * block_bytes / (1 << 20))
    assert engine.kv.num_blocks == 6
    assert generate(engine, PROMPTS, MAX_TOKENS) == references[kind]
    assert engine.stats()["preemptions"] > 0


def test_chunked_prefill_keeps_greedy_tokens(checkpoints, references):
    engine = make_engine(checkpoints["qwen2"], max_step_tokens=16, kv_block_size=16)
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


def test_bfloat16_runs_when_asked(checkpoints, references):
    engine = make_engine(checkpoints["llama"], dtype="bfloat16")
    assert engine.stats()["dtype"] == "bfloat16" and engine.kv.tensor.dtype == torch.bfloat16
    tokens = generate(engine, PROMPTS, MAX_TOKENS)
    assert [len(t) for t in tokens] == MAX_TOKENS
    # bfloat16 rounding changes late tokens of a random model; the first ones agree with float32.
    assert [t[0] for t in tokens] == [r[0] for r in references["llama"]]


def _edited_copy(source, tmp_path, **changes):
    path = tmp_path / "edited"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("changes, named", [
    ({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "yarn"),
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


def test_sliding_window_caps_max_model_len(checkpoints, tmp_path):
    path = _edited_copy(checkpoints["mistral"], tmp_path, sliding_window=64)
    engine = make_engine(path)
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len 64"):
        engine.add_request("long", list(range(60)), SamplingParams(max_tokens=5))


def test_gpt2_max_model_len_is_capped_by_its_positions(checkpoints):
    engine = Engine(Config(model=ModelConfig(path=str(checkpoints["gpt2"]), max_model_len=4096),
                           engine=EngineConfig(pool_bytes=4 << 20)), CPU)
    assert engine.max_model_len == 128  # n_positions
    assert engine.vocab_size == VOCAB_SIZE

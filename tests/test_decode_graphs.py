"""Decode steps through static, padded buffers (engine/decode_graphs.py): the same tokens as the
engine's ordinary steps. On a CPU the buffers run eagerly (the CUDA graphs' twin: the padding,
the reserved block and the full-width tables are what is tested); on a GPU, as graph replays."""
import pytest
import torch

from mcpd.engine import SamplingParams
from mcpd.engine.decode_graphs import DecodeGraphs, buckets
from test_models_vs_hf import MAX_TOKENS, PROMPTS, generate, make_engine
from tiny_checkpoints import KINDS, make_checkpoint

LLAMAS = tuple(kind for kind in KINDS if kind != "gpt2")
# Seven prompts: batches of 7 down to 1 as they finish, padded to buckets 8, 4, 2 and 1.
MANY_PROMPTS = PROMPTS + [[0, 1, 2, 3], [9] * 20]
MANY_TOKENS = MAX_TOKENS + [17, 25]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: make_checkpoint(root / kind, kind) for kind in LLAMAS}


def with_static_decode(engine, max_num_seqs=16):
    """The CPU twin: the engine's decode steps through DecodeGraphs' buffers, run eagerly."""
    engine.decode_graphs = DecodeGraphs(engine.model, engine.kv, max_num_seqs, engine.max_model_len, engine.device)
    return engine


def test_buckets_cover_every_batch_size_up_to_the_most():
    assert buckets(1) == [1]
    assert buckets(3) == [1, 2, 3]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("kind", LLAMAS)
def test_static_padded_decode_gives_the_ordinary_steps_tokens(kind, checkpoints):
    expected = generate(make_engine(checkpoints[kind], kernels="torch"), MANY_PROMPTS, MANY_TOKENS)
    engine = with_static_decode(make_engine(checkpoints[kind], kernels="torch"))
    assert generate(engine, MANY_PROMPTS, MANY_TOKENS) == expected
    assert sorted(engine.decode_graphs.steps) == [1, 2, 4, 8]   # the decodes ran through the buckets' buffers
    for prompt, n, tokens in zip(MANY_PROMPTS, MANY_TOKENS, expected):   # alone: bucket 1
        assert generate(engine, [prompt], [n]) == [tokens]


def test_more_sequences_than_the_largest_bucket_run_the_ordinary_way(checkpoints):
    expected = generate(make_engine(checkpoints["llama"], kernels="torch"), MANY_PROMPTS, MANY_TOKENS)
    engine = with_static_decode(make_engine(checkpoints["llama"], kernels="torch"), max_num_seqs=4)
    assert engine.decode_graphs.max_batch == 4
    assert generate(engine, MANY_PROMPTS, MANY_TOKENS) == expected
    assert sorted(engine.decode_graphs.steps) == buckets(4)   # from four sequences down, the buffers again


def test_the_padding_block_is_held_for_good_and_no_request_may_need_it(checkpoints):
    block_bytes = make_engine(checkpoints["llama"], kernels="torch").kv.tensor[0].nbytes
    # A cache of 5 blocks (80 tokens, under max_model_len) out of a 1 MiB pool.
    engine = make_engine(checkpoints["llama"], kernels="torch", pool_bytes=1 << 20,
                         kv_fraction=5.5 * block_bytes / (1 << 20))
    kv = engine.kv
    assert kv.num_blocks == 5
    used = engine.stats()["kv_blocks_used"]
    with_static_decode(engine)
    assert kv.usable_blocks == 4
    assert engine.stats()["kv_blocks_used"] == used + 1
    assert kv.ref_counts[engine.decode_graphs.scratch] == 1
    assert not kv.tensor[engine.decode_graphs.scratch].any()
    # Four blocks' worth runs (the last sampled token needs no slot); one token more is refused.
    engine.add_request("fits", [5] * 60, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with pytest.raises(ValueError, match=r"can never fit the KV cache \(64 tokens\)"):
        engine.add_request("too long", [5] * 61, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(tokens) for tokens in _drain(engine).values()] == [5]


def _drain(engine) -> dict:
    tokens = {}
    while engine.has_work:
        for out in engine.step():
            tokens.setdefault(out.key, []).extend(out.token_ids)
    return tokens


@GPU
@pytest.mark.parametrize("kind", LLAMAS)
def test_cuda_graph_replays_give_the_eager_steps_tokens(kind, checkpoints):
    cuda = torch.device("cuda")
    eager = make_engine(checkpoints[kind], dtype="float32", device=cuda, cuda_graphs=False)
    assert eager.decode_graphs is None and eager.stats()["kernels"] == "cuda"
    expected = generate(eager, MANY_PROMPTS, MANY_TOKENS)
    graphs = make_engine(checkpoints[kind], dtype="float32", device=cuda)
    assert generate(graphs, MANY_PROMPTS, MANY_TOKENS) == expected
    assert sorted(graphs.decode_graphs.graphs) == [1, 2, 4, 8]   # captured as the batch shrank
    for prompt, n, tokens in zip(MANY_PROMPTS, MANY_TOKENS, expected):
        assert generate(graphs, [prompt], [n]) == [tokens]

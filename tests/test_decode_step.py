"""The persistent decode-step kernel (kernels/cuda_decode_step.py) against the layer-by-layer
path through the same static buffers (engine/decode_graphs.py): in float32 the same greedy tokens
for every Llama-family kind it runs, alone and batched (buckets 8, 4, 2 and 1 as sequences
finish); in bfloat16 a step's logits within rounding of the other path's. On a GPU as graph
replays; on a CPU through Triton's interpreter, one program walking every stage (the kernel's
twin), where Triton is installed (`make setup-test` installs it)."""
import logging
import os
import re

import numpy as np
import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is off (tests/conftest.py turns it on)", allow_module_level=True)
triton = pytest.importorskip("triton")

from mcpd.engine import SamplingParams  # noqa: E402
from mcpd.engine.decode_graphs import DecodeGraphs  # noqa: E402
from mcpd.kernels.cuda_decode_step import MOST_ROWS, refusal  # noqa: E402
from test_models_vs_hf import PROMPTS, generate, make_engine  # noqa: E402
from tiny_checkpoints import make_checkpoint  # noqa: E402

DEVICE = torch.device("cuda" if GPU else "cpu")
RUN = ("llama", "llama3", "qwen2", "qwen2_untied", "llama_tied", "llama_linear")   # every kind it runs
INTERPRETED = ("llama", "llama3", "qwen2")   # plain, rope scaling, q/k/v bias with tied embeddings
REFUSED = {"mistral_window": "sliding window", "llama_dynamic": "length-dependent rope", "qwen3": "q/k norms",
           "mixtral": "experts", "gpt2": "not a Llama-family model", "gemma2": "not a Llama-family model"}
# Seven prompts: batches of 7 down to 1 as they finish, padded to buckets 8, 4, 2 and 1. The
# interpreter takes about a second a step: fewer tokens there.
MANY_PROMPTS = PROMPTS + [[0, 1, 2, 3], [9] * 20]
MANY_TOKENS = [12, 30, 7, 20, 6, 17, 25] if GPU else [3, 9, 2, 5, 1, 4, 7]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    needed = (*RUN, *REFUSED) if GPU else (*INTERPRETED, "qwen2_untied", *REFUSED)
    return {kind: make_checkpoint(root / kind, kind) for kind in needed}


@pytest.fixture(autouse=True, scope="module")
def bfloat16_dots_widened():
    """Triton's interpreter multiplies bfloat16 dot operands as their raw uint16 bits; widen them
    to float32 first, as the GPU's matrix units do (exactly: a bfloat16 is a truncated float32)."""
    if GPU:
        yield
        return
    from triton.runtime import interpreter
    dot = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype != triton.language.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32),
                                        triton.language.float32)

    interpreter.InterpreterBuilder.create_dot = lambda self, a, b, *rest: dot(self, widened(a), widened(b), *rest)
    yield
    interpreter.InterpreterBuilder.create_dot = dot


def engine_with(path, decode_kernel: str, dtype: str = "float32"):
    """An engine whose decode steps run through DecodeGraphs (graph replays on a GPU, eagerly on a
    CPU) with decode_kernel persistent or graph."""
    engine = make_engine(path, dtype=dtype, kernels="torch" if not GPU else "auto", device=DEVICE,
                         decode_kernel=decode_kernel)
    if not GPU:
        engine.decode_graphs = DecodeGraphs(engine.model, engine.kv, 16, engine.max_model_len, engine.device,
                                            decode_kernel)
    return engine


@pytest.mark.parametrize("kind", RUN if GPU else INTERPRETED)
def test_persistent_steps_give_the_layer_by_layer_tokens(kind, checkpoints):
    expected = generate(engine_with(checkpoints[kind], "graph"), MANY_PROMPTS, MANY_TOKENS)
    engine = engine_with(checkpoints[kind], "persistent")
    assert generate(engine, MANY_PROMPTS, MANY_TOKENS) == expected
    ran = {size for size, step in engine.decode_graphs.steps.items() if step is not None}
    assert ran == {1, 2, 4, 8}
    assert generate(engine, MANY_PROMPTS[-1:], MANY_TOKENS[-1:]) == expected[-1:]   # alone: bucket 1


@pytest.mark.skipif(not GPU, reason="auto times graph replays: CUDA only")
def test_auto_keeps_the_faster_of_the_two_per_bucket_and_its_tokens_are_the_same(checkpoints, caplog):
    expected = generate(engine_with(checkpoints["llama"], "graph"), MANY_PROMPTS, MANY_TOKENS)
    engine = engine_with(checkpoints["llama"], "auto")
    with caplog.at_level(logging.INFO, logger="mcpd.engine.decode_graphs"):
        assert generate(engine, MANY_PROMPTS, MANY_TOKENS) == expected
    kept = dict(re.match(r"decode steps of (\d+) sequences: (\w+)", r.getMessage()).groups()
                for r in caplog.records if r.name == "mcpd.engine.decode_graphs")
    assert set(kept) == {"1", "2", "4", "8"}
    assert all((engine.decode_graphs.steps[int(size)] is None) == (way == "graph") for size, way in kept.items())


@pytest.mark.parametrize("kind", ("llama", "qwen2_untied"))
def test_a_bfloat16_step_is_the_layer_by_layer_step_within_rounding(kind, checkpoints):
    """One decode step of four sequences (three prompts and one again), after their prefill."""
    engine = engine_with(checkpoints[kind], "graph", dtype="bfloat16")
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(i, prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    engine.step()
    sequences = [engine.sequences[i] for i in (0, 1, 2, 0)]
    step = ([s.token_ids[-1] for s in sequences], [list(s.block_table) for s in sequences],
            [len(s.token_ids) - 1 for s in sequences])
    layered = engine.decode_graphs.run(*step).clone()
    graphs = DecodeGraphs(engine.model, engine.kv, 16, engine.max_model_len, engine.device, "persistent")
    persistent = graphs.run(*step)
    assert graphs.steps[4] is not None
    assert (persistent - layered).abs().max() <= 0.05 * layered.abs().max()   # bfloat16's rounding, summed
    assert torch.equal(persistent[0], persistent[3])   # one sequence twice in a step: the same logits


@pytest.mark.parametrize("kind", REFUSED)
def test_what_it_does_not_run_is_refused_by_name_and_runs_layer_by_layer(kind, checkpoints):
    engine = make_engine(checkpoints[kind], kernels="torch")
    assert REFUSED[kind] in refusal(engine.model)
    graphs = DecodeGraphs(engine.model, engine.kv, 4, engine.max_model_len, engine.device, "persistent")
    engine.decode_graphs = graphs
    assert generate(engine, PROMPTS[:2], [2, 3]) == generate(make_engine(checkpoints[kind], kernels="torch"),
                                                            PROMPTS[:2], [2, 3])
    assert graphs.steps == {2: None, 1: None}


def test_batches_past_the_most_rows_run_layer_by_layer(checkpoints):
    engine = engine_with(checkpoints["llama"], "persistent")
    assert engine.decode_graphs._step(MOST_ROWS + 8) is None and engine.decode_graphs._step(MOST_ROWS) is not None

"""The bench's Q4_K_M writer (bench/peerkit/q4_k_m.py), which bench/gpu_decode.py --gguf q4_k_m
runs on a GPU's machine, where there is no llama.cpp: llama.cpp's choice of a type per matrix, and
a file mcpd loads whose matrices are the checkpoint's, quantized."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from peerkit import checkpoints, q4_k_m  # noqa: E402
from mcpd.config import Config, EngineConfig, ModelConfig  # noqa: E402
from mcpd.engine import Engine, SamplingParams  # noqa: E402
from tiny_gguf import gguf_name  # noqa: E402


def test_the_types_are_llamacpps_q4_k_m():
    """llama.cpp's use_more_bits over 22 layers (TinyLlama's, the 1B shape) picks these for Q6_K;
    the 55.3M shape's 1408-wide ffn_down falls back as llama.cpp's does."""
    chosen = q4_k_m.type_rule(22)
    assert [i for i in range(22) if chosen(f"blk.{i}.ffn_down.weight", 5632) == "Q6_K"] == [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    assert [i for i in range(22) if chosen(f"blk.{i}.attn_v.weight", 2048) == "Q6_K"] == [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    assert {chosen(f"blk.{i}.{m}.weight", 2048) for i in range(22) for m in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert (chosen("output.weight", 2048), chosen("token_embd.weight", 2048)) == ("Q6_K", "Q4_K")
    assert (chosen("blk.0.ffn_down.weight", 1408), chosen("blk.2.ffn_down.weight", 1408)) == ("Q8_0", "Q5_0")


def test_a_written_file_holds_the_checkpoints_weights_and_mcpd_runs_it(tmp_path):
    shape = q4_k_m.SMALL_SHAPE
    directory = checkpoints.write_checkpoint(tmp_path / "checkpoints" / "small", shape, checkpoints.byte_vocab(),
                                             torch.bfloat16)
    path = q4_k_m.written(directory, tmp_path)   # no llama-cpp-python sdist there: the byte vocab, as the checkpoint's
    assert path == q4_k_m.written(directory, tmp_path) and not list(path.parent.glob("*.partial"))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert Counter(t.tensor_type.name for t in tensors.values()) == {"Q4_K": 13, "Q6_K": 3, "F32": 5}
    weights = load_file(str(directory / "model.safetensors"))
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        tensor = tensors[gguf_name(name)]
        kept = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(weights[name].shape)
        original = weights[name].float().numpy()
        # half a Q4_K step (a block's range / 15: 2/15 of the largest weight at most) and the
        # rounding of its 6-bit scale; q and k are left out: their rows are permuted (rotary)
        assert np.abs(kept - original).max() <= 0.1 * np.abs(original).max(), name
    engine = Engine(Config(model=ModelConfig(path=str(path), max_model_len=256), engine=EngineConfig(pool_bytes=32 << 20)),
                    torch.device("cpu"))
    engine.add_request(0, list(range(3, 30)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    generated = []
    while engine.has_work:
        generated += [t for out in engine.step() for t in out.token_ids]
    assert len(generated) == 4

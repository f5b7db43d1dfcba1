"""A GGUF's Q8_0, Q5_0, Q4_0, Q4_1, Q4_K and Q6_K matrices stay quantized in memory (int8 in groups of 32, 4-bit
as the file's blocks), on every kernel set, and so do fused matrices whose pieces mix them (a
Q4_K_M's q/k/v: in parts, each in its own form): the weights the engine holds take no more than
1.1x the file's tensor bytes. (That they generate transformers' greedy tokens: tests/test_gguf.py.)"""
import gguf
import numpy as np
import pytest
import torch

from mcpd.kernels.forms import tensors_of
from mcpd.kernels.row_parts import RowParts
from mcpd.models.gguf_loader import _rotate_halves
from mcpd.quant.int4 import Int4Weight
from mcpd.quant.int8 import Int8Weight
from kernel_sets import NATIVE_SETS
from test_int4 import dequantized
from test_models_vs_hf import make_engine
from tiny_gguf import MIXES, write_gguf

FORMS = {"Q8_0": Int8Weight, "Q5_0": Int8Weight, "Q4_0": Int4Weight, "Q4_1": Int4Weight, "Q4_K": Int4Weight,
         "Q6_K": Int4Weight}
# (type, kind): qwen2's head is its embedding (tied); k-quants' super-blocks need inputs of 256s;
# the mixes are tiny_gguf.MIXES. Q5_0 is held as int8 (36 bytes a block of 22: lossless, and
# llama.cpp writes it only where a k-quant does not fit: its 55.3M Q4_K_M is held in 1.05x its size).
CASES = ([(q, kind) for q in ("Q8_0", "Q5_0", "Q4_0", "Q4_1") for kind in ("llama", "qwen2")]
         + [(q, "llama_wide") for q in ("Q4_K", "Q6_K", "Q4_K_M", "Q4_K_M_Q5_0")] + [("Q4_0_Q8_0", "qwen2")])


def held_bytes(model) -> int:
    """Bytes of every tensor the model's forms hold (the weights it runs on), each once."""
    tensors = {t.data_ptr(): t for form in model.forms.values() for t in tensors_of(form).values() if t.numel()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def file_tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


@pytest.mark.parametrize("kernels", ["torch", *NATIVE_SETS])
@pytest.mark.parametrize("qtype, kind", [case for case in CASES if "Q5_0" not in case[0]])
def test_weights_in_memory_take_at_most_1_1x_the_files_tensor_bytes(tmp_path, qtype, kind, kernels):
    path = write_gguf(tmp_path, kind, qtype)
    engine = make_engine(path, kernels=kernels)
    assert held_bytes(engine.model) <= 1.1 * file_tensor_bytes(path)


@pytest.mark.parametrize("qtype, kind", [case for case in CASES if case[1] != "qwen2" and case[0] not in MIXES])
def test_each_matrix_and_the_embedding_keep_their_files_form(tmp_path, qtype, kind):
    """On the torch kernels the forms are the quantized weights themselves."""
    engine = make_engine(write_gguf(tmp_path, kind, qtype), kernels="torch")
    forms = engine.model.forms
    matrices = [name for name in forms if name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight"))]
    assert len(matrices) == 2 + 2 * 4
    assert all(type(forms[name]) is FORMS[qtype] for name in matrices)


def test_a_fused_matrix_of_mixed_types_is_kept_in_parts_each_in_its_files_form(tmp_path):
    """Layer 0's q and k are Q4_K, its v Q6_K: one part of q and k's rows, one of v's; layer 1's
    q/k/v, all Q4_K, stays one matrix; its gate Q4_K and up Q5_0 are two parts, 4-bit and int8."""
    engine = make_engine(write_gguf(tmp_path, "llama_wide", "Q4_K_M_Q5_0"), kernels="torch")
    layers = engine.model.weights.layers
    qkv, gate_up = layers[0].qkv, layers[1].gate_up
    assert type(qkv) is RowParts and qkv.rows == (256 + 128, 128)   # 4 heads of 64, 2 KV heads
    assert [(part.supers.shape[-1], part.highs is not None) for part in qkv.parts] == [(2, False), (1, True)]
    assert type(layers[1].qkv) is Int4Weight
    assert type(gate_up) is RowParts and gate_up.rows == (512, 512)
    assert [type(part) for part in gate_up.parts] == [Int4Weight, Int8Weight]


@pytest.mark.parametrize("kind, qtype", [("llama_wide", "Q4_K_M"), ("llama_wide", "Q4_K_M_Q5_0"), ("qwen2", "Q4_0_Q8_0")])
def test_the_parts_hold_the_files_weights_bit_for_bit(tmp_path, kind, qtype):
    """Each part's weights, dequantized, are the gguf package's of the file's tensors, in row
    order (a Llama's q and k rows put back from llama.cpp's order)."""
    path = write_gguf(tmp_path, kind, qtype)
    engine = make_engine(path, kernels="torch")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    heads = {"attn_q": 4, "attn_k": 2} if kind == "llama_wide" else {}
    for index, layer in enumerate(engine.model.weights.layers):
        for matrix, pieces in ((layer.qkv, ("attn_q", "attn_k", "attn_v")), (layer.gate_up, ("ffn_gate", "ffn_up"))):
            parts = matrix.parts if isinstance(matrix, RowParts) else (matrix,)
            held = torch.cat([dequantized(part) for part in parts])
            expected = [_file_weights(tensors[f"blk.{index}.{piece}.weight"], heads.get(piece)) for piece in pieces]
            assert torch.equal(held, torch.from_numpy(np.concatenate(expected)))


def _file_weights(tensor, heads: int | None) -> np.ndarray:
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(int(tensor.shape[1]), -1)
    return weights if heads is None else _rotate_halves(weights, heads)

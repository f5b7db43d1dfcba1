"""A GGUF's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K matrices stay quantized in memory (int8 in groups of 32, 4-bit
as the file's blocks), on every kernel set: the weights the engine holds take no more than 1.1x
the file's tensor bytes. (That they generate transformers' greedy tokens: tests/test_gguf.py.)"""
import gguf
import pytest

from mcpd.kernels.forms import tensors_of
from mcpd.quant.int4 import Int4Weight
from mcpd.quant.int8 import Int8Weight
from kernel_sets import NATIVE_SETS
from test_models_vs_hf import make_engine
from tiny_gguf import write_gguf

FORMS = {"Q8_0": Int8Weight, "Q4_0": Int4Weight, "Q4_1": Int4Weight, "Q4_K": Int4Weight, "Q6_K": Int4Weight}
# (type, kind): qwen2's head is its embedding (tied); k-quants' super-blocks need inputs of 256s.
CASES = [(q, kind) for q in ("Q8_0", "Q4_0", "Q4_1") for kind in ("llama", "qwen2")] + [(q, "llama_wide") for q in ("Q4_K", "Q6_K")]


def held_bytes(model) -> int:
    """Bytes of every tensor the model's forms hold (the weights it runs on), each once."""
    tensors = {t.data_ptr(): t for form in model.forms.values() for t in tensors_of(form).values() if t.numel()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def file_tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


@pytest.mark.parametrize("kernels", ["torch", *NATIVE_SETS])
@pytest.mark.parametrize("qtype, kind", CASES)
def test_weights_in_memory_take_at_most_1_1x_the_files_tensor_bytes(tmp_path, qtype, kind, kernels):
    path = write_gguf(tmp_path, kind, qtype)
    engine = make_engine(path, kernels=kernels)
    assert held_bytes(engine.model) <= 1.1 * file_tensor_bytes(path)


@pytest.mark.parametrize("qtype, kind", [case for case in CASES if case[1] != "qwen2"])
def test_each_matrix_and_the_embedding_keep_their_files_form(tmp_path, qtype, kind):
    """On the torch kernels the forms are the quantized weights themselves."""
    engine = make_engine(write_gguf(tmp_path, kind, qtype), kernels="torch")
    forms = engine.model.forms
    matrices = [name for name in forms if name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight"))]
    assert len(matrices) == 2 + 2 * 4
    assert all(type(forms[name]) is FORMS[qtype] for name in matrices)

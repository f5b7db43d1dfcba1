"""The pool keeper sizes a pool without torch (parameter_table.py): its table of each model's
parameters must be the skeleton the loader builds, name for name, shape and dtype, for every
kind of model mcpd runs, so the bytes it reserves are what the workers' weights take; and a
model the loader refuses, it refuses alike."""
import os

import pytest
import torch

from mcpd.config import ConfigError, ModelConfig, from_dict
from mcpd.daemon import pool_keeper
from mcpd.memory import pool_size
from mcpd.models import UnsupportedModel, architecture, skeleton
from mcpd.models.parameter_table import parameter_bytes, parameters
from tiny_checkpoints import KINDS, VARIANTS, edited_copy, make_checkpoint
from tiny_gguf import write_gguf

CPU = torch.device("cpu")
LLAMAS = tuple(kind for kind in KINDS if kind != "gpt2")
# Llama's optional biases and a tied head, which none of the tiny checkpoints has.
LLAMA_EDITS = {"biases": {"attention_bias": True, "mlp_bias": True}, "tied": {"tie_word_embeddings": True}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    made = {kind: make_checkpoint(root / kind, kind) for kind in (*KINDS, *VARIANTS)}
    made["bf16"] = make_checkpoint(root / "bf16", "llama", dtype=torch.bfloat16)
    for name, changes in LLAMA_EDITS.items():
        made[name] = edited_copy(made["llama"], root / name, **changes)
    return made


def built(config: ModelConfig, device: torch.device) -> dict:
    return {name: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in skeleton(config, device).named_parameters()}


def skeleton_bytes(config: ModelConfig) -> int:
    """The figure the keeper had from a skeleton it built (with torch) before."""
    return sum(p.numel() * p.element_size() for p in skeleton(config, CPU).parameters())


CASES = ([(kind, "none", dtype) for kind in (*KINDS, *VARIANTS, *LLAMA_EDITS, "bf16", "embedded")
          for dtype in ("auto", "float16", "bfloat16")]
         + [(kind, "int8", "auto") for kind in (*LLAMAS, *LLAMA_EDITS, "embedded")])


@pytest.mark.parametrize("kind, quantization, dtype", CASES)
def test_the_table_is_the_skeleton(checkpoints, kind, quantization, dtype):
    path = "" if kind == "embedded" else str(checkpoints[kind])
    config = ModelConfig(path=path, dtype=dtype, quantization=quantization)
    assert parameters(architecture.of(config, "cpu")) == built(config, CPU)
    assert parameter_bytes(config, "cpu") == skeleton_bytes(config)


@pytest.mark.parametrize("kind, qtype", [("llama_wide", "Q4_K_M_Q5_0"), ("qwen2", "Q4_0_Q8_0"), ("llama", "Q5_0")])
def test_the_table_is_the_skeleton_of_a_gguf_whose_fused_matrices_mix_types(tmp_path, kind, qtype):
    """Fused matrices kept in parts of different forms (split_linear.py), qwen2's with the bias."""
    config = ModelConfig(path=str(write_gguf(tmp_path, kind, qtype)))
    assert parameters(architecture.of(config, "cpu")) == built(config, CPU)
    assert parameter_bytes(config, "cpu") == skeleton_bytes(config)


@pytest.mark.parametrize("kind", ["bf16", "embedded"])
def test_the_table_is_the_skeleton_on_a_gpu(checkpoints, kind):
    """dtype auto keeps a half-precision checkpoint's dtype on a GPU (float32 on the CPU). The
    meta device stands in for one: the loader treats every device but the CPU alike."""
    config = ModelConfig(path="" if kind == "embedded" else str(checkpoints[kind]))
    table = parameters(architecture.of(config, "cuda"))
    assert table == built(config, torch.device("meta"))
    assert {dtype for _, dtype in table.values()} == {"bfloat16" if kind == "bf16" else "float32"}


def test_a_pool_for_several_models_holds_each_workers_parameters(checkpoints):
    """[models]: each worker's share and its own version's parameters."""
    config = from_dict({"engine": {"pool_bytes": 8 << 20}, "models": {"tiny": {"default": "a", "versions": {
        "a": {"path": str(checkpoints["llama"]), "workers": 2},
        "b": {"path": str(checkpoints["gpt2"])},
        "c": {"path": "", "quantization": "int8"}}}}})
    versions = [config.models[m].versions[v] for m, v in config.worker_versions()]
    share = pool_size.resolve_bytes(8 << 20, "cpu") * pool_keeper.AUTO_HEADROOM
    assert pool_keeper.pool_bytes(config, "cpu", 4) == int(sum(share + skeleton_bytes(v) for v in versions))


@pytest.mark.parametrize("changes, named", [
    ({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
    ({"rope_parameters": {"rope_type": "proportional", "factor": 4.0, "rope_theta": 10000.0}}, "proportional"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "awq"}}, "awq"),
    ({"torch_dtype": "float64"}, "float64"),
    ({"num_attention_heads": None}, "lacks 'num_attention_heads'"),
    # hostile counts: refused by name before anything is listed or built
    ({"num_hidden_layers": 10 ** 9}, "num_hidden_layers 1000000000 is not a whole number from 1 to 4096"),
    ({"vocab_size": 2 ** 62}, "vocab_size"),
    ({"hidden_size": "512"}, "hidden_size '512' is not a whole number"),
    ({"intermediate_size": 0}, "intermediate_size 0"),
    ({"num_attention_heads": 0}, "num_attention_heads 0 is not"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads 0 is not"),   # never hidden_size // 0
    ({"num_key_value_heads": 3}, "cannot share 3 KV heads evenly"),
    ({"max_position_embeddings": True}, "max_position_embeddings True is not a whole number"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps nan is not a finite positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta -1.0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": "x", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "rope_theta": 10000.0}}, "rope factor 'x' is not a finite positive number"),
    ({"architectures": 5}, "architectures 5 is not a list of names"),
    ({"architectures": [["LlamaForCausalLM"]]}, r"architectures \[\['LlamaForCausalLM'\]\] is not a list of names"),
])
def test_a_refused_model_is_refused_alike(checkpoints, tmp_path, changes, named):
    config = ModelConfig(path=str(edited_copy(checkpoints["llama"], tmp_path / "edited", **changes)))
    with pytest.raises(UnsupportedModel, match=named) as by_table:
        parameter_bytes(config, "cpu")
    with pytest.raises(UnsupportedModel) as by_loader:
        skeleton(config, CPU)
    assert str(by_table.value) == str(by_loader.value)


@pytest.mark.parametrize("make, named", [
    (lambda path: path.mkdir(), r"cannot be read \(Is a directory\)"),
    (lambda path: path.write_text("[1, 2]"), "not a JSON object"),
    (lambda path: path.write_text('{"vocab_size": ' + "9" * 5000 + "}"), "not valid JSON"),
    (lambda path: path.write_bytes(b"\xff\xfe{}"), "not valid JSON"),
    (lambda path: path.write_text("[" * 100_000 + "]" * 100_000), "not valid JSON"),   # RecursionError
    (lambda path: path.symlink_to("/dev/zero"), r"not valid JSON \(not a regular file\)"),
])
def test_a_config_json_that_is_no_json_object_is_refused_by_name(checkpoints, tmp_path, make, named):
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    (path / "config.json").unlink()
    make(path / "config.json")
    with pytest.raises(UnsupportedModel, match=named):
        parameter_bytes(ModelConfig(path=str(path)), "cpu")


@pytest.mark.parametrize("name, plant, says", [
    ("tokenizer_config.json", lambda path: path.write_text("[1]"), "not a JSON object"),
    ("tokenizer_config.json", lambda path: path.write_text("{nope"), "not a readable JSON object"),
    ("generation_config.json", os.mkfifo, "not a readable JSON object (not a regular file)"),
])
def test_a_tokenizer_json_the_children_could_not_read_is_refused_by_the_supervisor(checkpoints, tmp_path, name,
                                                                                   plant, says):
    """Checked with the model at start and reload: a worker meeting it would crash at every restart (a FIFO hang it)."""
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    (path / name).unlink(missing_ok=True)
    plant(path / name)
    with pytest.raises(ConfigError) as e:
        architecture.check_configured(from_dict({"model": {"path": str(path)}}))
    assert str(e.value).startswith(f"model: {path / name}: {says}"), str(e.value)


def test_int8_gpt2_is_refused_alike(checkpoints):
    config = ModelConfig(path=str(checkpoints["gpt2"]), quantization="int8")
    with pytest.raises(UnsupportedModel, match="Llama family only") as by_table:
        parameter_bytes(config, "cpu")
    with pytest.raises(UnsupportedModel) as by_loader:
        skeleton(config, CPU)
    assert str(by_table.value) == str(by_loader.value)

"""Checkpoint variants that real models use (tiny_checkpoints.VARIANTS): windows across chunks,
blocks and preemption, which kernels run what, and refusals by name. (Every variant's greedy
tokens and logits against transformers: test_models_vs_hf.py.)"""
import json

import pytest

from mcpd.config import ModelConfig
from mcpd.kernels.native import NativeUnavailable
from mcpd.models import UnsupportedModel, load_model
from test_models_vs_hf import CPU, MAX_TOKENS, PROMPTS, _edited_copy, _hf_greedy, generate, make_engine
from tiny_checkpoints import VARIANTS, load_hf, make_checkpoint

WINDOWED = ("mistral_window", "qwen2_window")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return {kind: make_checkpoint(root / kind, kind) for kind in VARIANTS}


@pytest.fixture(scope="module")
def references(checkpoints):
    return {kind: _hf_greedy(load_hf(checkpoints[kind]), PROMPTS, MAX_TOKENS) for kind in WINDOWED}


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_an_untied_checkpoint_without_its_head_is_refused(kind, tmp_path):
    """config.json says the head is its own, and the weights hold none: refused, naming it, rather
    than run with the embedding as the head."""
    tied = make_checkpoint(tmp_path / "tied", kind)
    with pytest.raises(UnsupportedModel, match="lacks weights for lm_head.weight"):
        make_engine(_edited_copy(tied, tmp_path, tie_word_embeddings=False))


@pytest.mark.parametrize("kind", WINDOWED)
def test_a_sliding_window_keeps_greedy_tokens_chunked_and_preempted(kind, checkpoints, references):
    """Prompts many windows long, prefilled in chunks of 5 over blocks of 4 tokens, in a cache
    too small for all of them at once: windows that span chunks, blocks and a recomputation."""
    block_bytes = make_engine(checkpoints[kind], kv_block_size=4).kv.tensor[0].nbytes
    engine = make_engine(checkpoints[kind], max_step_tokens=5, kv_block_size=4, pool_bytes=1 << 20,
                         kv_fraction=24.5 * block_bytes / (1 << 20))
    assert engine.max_model_len == 128   # the window caps nothing
    assert generate(engine, PROMPTS, MAX_TOKENS) == references[kind]
    assert engine.stats()["preemptions"] > 0


@pytest.mark.parametrize("kind", WINDOWED)
def test_the_native_kernels_refuse_a_sliding_window_and_auto_takes_torch(kind, checkpoints):
    with pytest.raises(NativeUnavailable, match="sliding-window attention"):
        make_engine(checkpoints[kind], kernels="native")
    engine = make_engine(checkpoints[kind], kernels="auto")
    assert engine.stats()["kernels"] == "torch" and "sliding-window attention" in engine.kernels_reason


def test_a_window_no_sequence_exceeds_is_full_attention_on_any_kernels(checkpoints):
    loaded = load_model(ModelConfig(path=str(checkpoints["mistral_window"]), max_model_len=6), CPU, "native")
    assert loaded.max_model_len == 6 and loaded.kernels_reason.startswith("native kernels")


@pytest.mark.parametrize("changes, named", [
    ({"layer_types": ["sliding_attention"]}, "is not a list of 2 layer types"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, r"layer_types \['chunked_attention'\]"),
    ({"sliding_window": 0}, "sliding_window 0 is not a whole number"),
    ({"sliding_window": "9"}, "sliding_window '9' is not a whole number"),
])
def test_a_hostile_window_is_refused_by_name(checkpoints, tmp_path, changes, named):
    with pytest.raises(UnsupportedModel, match=named):
        make_engine(_edited_copy(checkpoints["qwen2_window"], tmp_path, **changes))


@pytest.mark.parametrize("kind, rope, named", [
    ("llama_longrope", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7,
                        "original_max_position_embeddings": 32}, "8 short and 7 long for 8 frequencies"),
    ("llama_longrope", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [-2.0],
                        "original_max_position_embeddings": 32}, "rope long_factor -2.0 is not a finite positive"),
    ("qwen2_yarn", {"rope_type": "yarn", "factor": float("inf"), "original_max_position_embeddings": 32},
     "rope factor inf is not a finite positive number"),
    ("llama_dynamic", {"rope_type": "dynamic", "factor": -4.0}, "rope factor -4.0 is not a finite positive number"),
    ("llama_linear", {"rope_type": "linear", "factor": "2"}, "rope factor '2' is not a finite positive number"),
])
def test_a_hostile_rope_scaling_is_refused_by_name(kind, rope, named, checkpoints, tmp_path):
    with pytest.raises(UnsupportedModel, match=named):
        make_engine(_edited_copy(checkpoints[kind], tmp_path, rope_parameters=None, rope_scaling=rope))


def test_a_rope_scaling_stretches_the_context(checkpoints, tmp_path):
    """max_position_embeddings (and yarn's original) times the factor, as vLLM reads them. yarn's
    factor is raised to 8: the checkpoint's original 32 times 4 is its max_position_embeddings."""
    yarn = json.loads((checkpoints["qwen2_yarn"] / "config.json").read_text())["rope_parameters"]
    paths = {kind: checkpoints[kind] for kind in ("llama_linear", "llama_dynamic", "llama_longrope")}
    paths["qwen2_yarn"] = _edited_copy(checkpoints["qwen2_yarn"], tmp_path, rope_parameters={**yarn, "factor": 8.0})
    lengths = {kind: load_model(ModelConfig(path=str(path), max_model_len=1 << 20), CPU).max_model_len
               for kind, path in paths.items()}
    assert lengths == {"llama_linear": 64 * 2, "llama_dynamic": 32 * 4, "qwen2_yarn": 32 * 8, "llama_longrope": 128}


@pytest.mark.parametrize("kind, changes, named", [
    ("gemma3", {"use_bidirectional_attention": True}, "Gemma3ForCausalLM: use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping -1.0 is not a finite positive number"),
    ("gemma2", {"final_logit_softcapping": "30"}, "final_logit_softcapping '30' is not a finite positive number"),
    ("gemma2", {"rms_norm_eps": None}, "rms_norm_eps None is not a finite positive number"),
    ("gemma2", {"layer_types": ["full_attention"]}, "Gemma2ForCausalLM: layer_types"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "proportional"}}}, "'proportional'"),
    ("gemma2", {"architectures": ["Qwen2MoeForCausalLM"]}, "'Qwen2MoeForCausalLM' is not supported"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts 0 is not a whole number from 1 to 1024"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 is not a whole number from 1 to 4"),
    ("mixtral", {"num_experts_per_tok": 1.5}, "num_experts_per_tok 1.5 is not a whole number"),
])
def test_an_unsupported_or_hostile_family_config_is_refused_by_name(kind, changes, named, checkpoints, tmp_path):
    with pytest.raises(UnsupportedModel, match=named):
        make_engine(_edited_copy(checkpoints[kind], tmp_path, **changes))


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen3", "mixtral"])
def test_native_is_refused_for_a_family_only_torch_runs(kind, checkpoints):
    with pytest.raises(NativeUnavailable, match="native kernels have no"):
        make_engine(checkpoints[kind], kernels="native")


@pytest.mark.parametrize("kind, named", [("gemma2", "for the Llama family only"),
                                         ("mixtral", "of a mixture of experts")])
def test_int8_is_refused_for_gemma_and_mixtral(kind, named, checkpoints):
    with pytest.raises(UnsupportedModel, match=named):
        load_model(ModelConfig(path=str(checkpoints[kind]), quantization="int8"), CPU)

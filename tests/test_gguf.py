"""GGUF files as models: tiny ones written here with the gguf package's writer and quantizers load
and generate the greedy tokens transformers generates from the same file (it dequantizes and
un-permutes them too); the tokenizer built from a file's metadata encodes as transformers' does;
and a file that lies is refused, naming the file and the lie, before anything large is allocated."""
import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from mcpd import default_model
from mcpd.config import Config, ConfigError, ModelConfig
from mcpd.models import UnsupportedModel, architecture
from mcpd.tokenizer import HFTokenizer
from kernel_sets import NATIVE_SETS
from test_models_vs_hf import MAX_TOKENS, PROMPTS, _hf_greedy, generate, make_engine
from tiny_checkpoints import CORPUS
from tiny_gguf import write_gguf

# (kind, tensor type, kernels): every type on llama, the common ones on qwen2 (biases, tied head),
# on the torch kernels; the types kept quantized (Q8_0, Q5_0, Q4_0, Q4_1) on each native set too.
# Q4_K and Q6_K need inputs of 256s: a wider llama. The mixes (tiny_gguf.MIXES) split fused
# matrices into parts of different forms, qwen2's with its q/k/v bias.
CASES = ([("llama", q, "torch") for q in ("F32", "F16", "Q8_0", "Q5_0", "Q4_0", "Q4_1")]
         + [("qwen2", q, "torch") for q in ("F32", "Q8_0", "Q4_1")]
         + [(kind, q, s) for s in NATIVE_SETS for kind in ("llama", "qwen2") for q in ("Q8_0", "Q4_0", "Q4_1")]
         + [("llama", "Q5_0", s) for s in NATIVE_SETS]
         + [("llama_wide", q, s) for s in ("torch", *NATIVE_SETS) for q in ("Q4_K", "Q6_K", "Q4_K_M", "Q4_K_M_Q5_0")]
         + [("qwen2", "Q4_0_Q8_0", s) for s in ("torch", *NATIVE_SETS)])


def hf_gguf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # full lengths: mcpd runs with ignore_eos
    return model


@pytest.fixture(scope="module")
def transformers_greedy(tmp_path_factory):
    """(kind, tensor type) -> (a file of it, transformers' greedy tokens from it), made at first
    use: every kernel set of one type is held to the same file and tokens."""
    made = {}

    def of(kind: str, qtype: str):
        if (kind, qtype) not in made:
            path = write_gguf(tmp_path_factory.mktemp(f"{kind}-{qtype}"), kind, qtype)
            made[kind, qtype] = path, _hf_greedy(hf_gguf_model(path), PROMPTS, MAX_TOKENS)
        return made[kind, qtype]
    return of


@pytest.mark.slow
@pytest.mark.parametrize("kind, qtype, kernels", CASES)
def test_greedy_tokens_match_transformers_on_the_same_file(transformers_greedy, kind, qtype, kernels):
    path, expected = transformers_greedy(kind, qtype)
    engine = make_engine(path, kernels=kernels)
    assert generate(engine, PROMPTS, MAX_TOKENS) == expected
    for prompt, n, tokens in zip(PROMPTS, MAX_TOKENS, expected):
        assert generate(engine, [prompt], [n]) == [tokens]


def test_a_loaded_model_keeps_no_map_of_its_file(tmp_path):
    """The weights are copied out at load: the file's pages, all read once, must not stay mapped
    (resident) in the worker for its lifetime."""
    import gc

    path = write_gguf(tmp_path, "llama", "Q8_0")
    engine = make_engine(path, kernels="torch")
    gc.collect()
    assert engine.model is not None
    assert str(path) not in open("/proc/self/maps").read()


def test_the_q_and_k_rows_are_put_back_in_the_checkpoints_order(tmp_path):
    """llama.cpp's converter permutes a Llama's Q and K rows; loading must undo it exactly: the
    F32 file's model is the checkpoint's, weight for weight."""
    path = write_gguf(tmp_path, "llama", "F32")
    from_gguf = make_engine(path, kernels="torch")
    from_checkpoint = make_engine(tmp_path / "hf", kernels="torch")
    mine = dict(from_gguf.model.named_parameters())
    for name, param in from_checkpoint.model.named_parameters():
        assert torch.equal(mine[name], param), name


def strings() -> list[str]:
    """A few hundred texts: the corpus, its words recombined, digits, whitespace runs, bytes
    beyond ASCII and special-token text."""
    words = sorted({w for line in CORPUS for w in line.split()})
    texts = list(dict.fromkeys(CORPUS))
    texts += [" ".join(words[i:i + 4]) for i in range(len(words))]
    texts += [f"{w} {i * 37} {w.upper()}  \n\t{w}!" for i, w in enumerate(words)]
    texts += ["", " ", "  leading", "trailing  ", "a\n\nb", "1234567890", "x=3.14159;", "</s> <s>hi</s>",
              "ünïcödé", "漢字かな", "🙂🙃 emoji", "tab\tand\r\nnewline", "'s 've 'll 're", "HELLO World"]
    texts += [f"{w}{words[(i * 7) % len(words)]}'s, ({i}){w[:2]}" for i, w in enumerate(words)]
    texts += [f"{n} + {n * n} = {n + n * n}{' ' * (n % 4)}" for n in range(0, 1200, 37)]
    texts += [text[::-1] for text in texts]
    return texts


@pytest.mark.slow
@pytest.mark.parametrize("pre, sentencepiece", [("default", False), ("smollm", False), ("llama-bpe", False),
                                                ("qwen2", False), ("default", True)])
def test_tokenizer_encodes_as_transformers_does_from_the_same_file(tmp_path, pre, sentencepiece):
    path = write_gguf(tmp_path, "llama", "F32", pre=pre, sentencepiece=sentencepiece)
    mine = HFTokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = strings()
    assert len(texts) >= 300
    for text in texts:
        ids = mine.encode(text)
        assert ids == theirs.encode(text), text
        assert mine.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert mine.bos_token_id == theirs.bos_token_id and theirs.eos_token_id in mine.eos_token_ids


@pytest.mark.slow
def test_smollm2_tokenizer_and_template_are_transformers_ones(smollm2):
    """SmolLM2's file: its documentation-like text, and a ChatML chat with its default system prompt."""
    mine = HFTokenizer.from_gguf(smollm2)
    theirs = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    readme = (os.path.dirname(__file__) + "/../README.md")
    lines = [line for line in open(readme, encoding="utf-8").read().splitlines() if line.strip()][:200]
    for text in lines + strings()[:100]:
        assert mine.encode(text) == theirs.encode(text), text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert mine.encode_chat(chat) == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert mine.eos_token_ids == {theirs.convert_tokens_to_ids("<|im_end|>")}


def test_the_architecture_comes_from_the_metadata(tmp_path):
    path = write_gguf(tmp_path, "qwen2", "Q8_0")
    arch = architecture.of(ModelConfig(path=str(path)), "cpu")
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert (arch.args.hidden_size, arch.args.num_layers, arch.args.num_heads, arch.args.num_kv_heads) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads)
    assert arch.args.qkv_bias and arch.args.tie_embeddings and arch.dtype == "float32"
    assert arch.model_len == hf.max_position_embeddings and arch.vocab_size == hf.vocab_size


def test_llama3_rope_scaling_is_read_back_from_rope_freqs(tmp_path):
    """llama.cpp's converter stores Llama 3.1's scaling as one divisor per rotary frequency; the
    scaling read back from them gives the same frequencies as the checkpoint's own."""
    from mcpd.models.rope_frequencies import llama3_scaled
    from mcpd.models.rope_scaling import Llama3RopeScaling

    scaling = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    head_dim, theta = 32, 10000.0   # the tiny llama's: two of its frequencies fall in the smoothed band
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    divisors = (inv_freq / llama3_scaled(inv_freq, scaling)).numpy()
    assert ((divisors > 1) & (divisors < 8)).sum() == 2
    path = write_gguf(tmp_path, "llama", "F32", rope_freqs=divisors)
    read = architecture.of(ModelConfig(path=str(path)), "cpu").args.rope_scaling
    assert torch.allclose(llama3_scaled(inv_freq, read), llama3_scaled(inv_freq, scaling), rtol=1e-5)


# -- files that lie ------------------------------------------------------------------------------

def edited(path, edit):
    """path, with edit(reader) applied to its bytes in place through the gguf reader's map."""
    reader = gguf.GGUFReader(path, "r+")
    edit(reader)
    reader.data.flush()
    del reader
    return path


def refused(path) -> str:
    with pytest.raises(UnsupportedModel) as caught:
        architecture.of(ModelConfig(path=str(path)), "cpu")
    with pytest.raises(ConfigError):   # as the supervisor sees it at start and at reload
        architecture.check_configured(Config(model=ModelConfig(path=str(path))))
    assert str(path) in str(caught.value)
    return str(caught.value).replace(str(path), "<path>")   # the reason alone: tmp_path holds the test's name


def test_tensor_data_past_the_end_is_refused(tmp_path):
    path = edited(write_gguf(tmp_path, "llama", "Q8_0"), lambda r: r.tensors[-1].field.parts[-1].__setitem__(0, 1 << 40))
    assert "not a readable GGUF file" in refused(path)


def test_shapes_that_disagree_with_the_metadata_are_refused(tmp_path):
    path = edited(write_gguf(tmp_path, "llama", "F16"),
                  lambda r: r.fields["llama.feed_forward_length"].parts[-1].__setitem__(0, 96))
    assert "has shape" in refused(path) and "the metadata gives" in refused(path)


def test_a_vocabulary_of_two_to_the_forty_is_refused(tmp_path):
    counted = edited(write_gguf(tmp_path / "a", "llama", "F32"),
                     lambda r: r.fields["tokenizer.ggml.tokens"].parts[4].__setitem__(0, 1 << 40))
    assert "not a readable GGUF file" in refused(counted)
    sized = edited(write_gguf(tmp_path / "b", "llama", "F32"),
                   lambda r: r.fields["llama.vocab_size"].parts[-1].__setitem__(0, (1 << 32) - 1))
    assert "vocab_size" in refused(sized)


def test_a_four_gib_string_is_refused(tmp_path):
    path = edited(write_gguf(tmp_path, "llama", "F32"),
                  lambda r: r.fields["tokenizer.chat_template"].parts[3].__setitem__(0, 4 << 30))
    assert "not a readable GGUF file" in refused(path)


def test_an_unknown_type_id_is_refused_with_its_number(tmp_path):
    path = edited(write_gguf(tmp_path, "llama", "Q4_0"), lambda r: r.tensors[3].field.parts[-2].__setitem__(0, 99))
    assert "99" in refused(path)


def test_a_known_type_without_support_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path, "llama", "Q5_1")
    assert "type Q5_1" in refused(path)


def test_an_architecture_not_run_here_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path, "llama", "F32", arch="phi3")
    assert "'phi3' is not supported" in refused(path)


def test_rope_divisors_that_lie_are_refused(tmp_path):
    divisors = np.ones(16, np.float32)
    divisors[3] = np.nan
    assert "divisors must be finite" in refused(write_gguf(tmp_path / "nan", "llama", "F32", rope_freqs=divisors))
    smoothed_alike = np.array([1.0] * 10 + [2.0, 2.0] + [8.0] * 4, np.float32)   # no slope to read
    assert "unusable metadata" in refused(write_gguf(tmp_path / "flat", "llama", "F32", rope_freqs=smoothed_alike))


def test_a_tokenizer_that_cannot_be_built_is_refused_at_the_config_check(tmp_path):
    path = write_gguf(tmp_path, "llama", "F32", pre="made-up")
    with pytest.raises(ConfigError, match="tokenizer.ggml.pre 'made-up' is not supported"):
        architecture.check_configured(Config(model=ModelConfig(path=str(path))))
    lying = edited(write_gguf(tmp_path / "eos", "llama", "F32"),
                   lambda r: r.fields["tokenizer.ggml.eos_token_id"].parts[-1].__setitem__(0, 70000))
    with pytest.raises(ConfigError, match="eos_token_id = 70000: not one of the"):
        architecture.check_configured(Config(model=ModelConfig(path=str(lying))))


def test_a_chat_template_that_does_not_compile_is_refused_at_the_config_check(tmp_path):
    """The supervisor builds the tokenizer as the scheduler and workers do, template and all:
    "{% bos_token }}" is no Jinja, and a worker meeting it would be restarted for ever."""
    path = edited(write_gguf(tmp_path, "llama", "F32"),
                  lambda r: r.fields["tokenizer.chat_template"].parts[-1].__setitem__(1, ord("%")))
    with pytest.raises(ConfigError) as refused:
        architecture.check_configured(Config(model=ModelConfig(path=str(path))))
    assert str(refused.value) == f"model: {path}: chat template: Encountered unknown tag 'bos_token'."


def test_a_truncated_file_is_refused(tmp_path):
    path = write_gguf(tmp_path, "llama", "Q8_0")
    whole = path.read_bytes()
    for length in (10, 1000, len(whole) // 2, len(whole) - 1):
        cut = tmp_path / f"cut-{length}.gguf"
        cut.write_bytes(whole[:length])
        assert "truncated" in refused(cut) or "not a readable GGUF file" in refused(cut)


def test_a_link_to_dev_zero_and_a_directory_are_refused(tmp_path):
    (tmp_path / "zero.gguf").symlink_to("/dev/zero")
    assert "not a regular file" in refused(tmp_path / "zero.gguf")
    (tmp_path / "dir.gguf").mkdir()
    assert "not a regular file" in refused(tmp_path / "dir.gguf")


def test_a_missing_file_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig(path="/nonexistent/model.gguf").check()


def test_auto_names_the_installed_smollm2(smollm2):
    import logging

    config = default_model.resolved(Config(model=ModelConfig(path="auto")), logging.getLogger("test"))
    assert config.model.path == str(smollm2)
    arch = architecture.of(config.model, "cpu")
    assert (arch.args.num_layers, arch.args.hidden_size, arch.args.num_heads, arch.args.num_kv_heads,
            arch.vocab_size, arch.args.tie_embeddings) == (30, 576, 9, 3, 49152, True)

"""The peers benchmark's checkpoint builder (bench/peerkit/checkpoints.py) and its figure convention.

The benchmark itself needs the peers' venvs and minutes; these check, in seconds and without the
llama-cpp-python sdist or a network, what its figures rest on: that mcpd loads the checkpoint,
that transformers (vLLM's tokenizer) and mcpd's tokenizer read the same ids from it, that the
Llama-2 merges rebuilt from SentencePiece scores tokenize as SentencePiece does, and which way
the ratios point.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import peers  # noqa: E402
from peerkit import checkpoints, trained  # noqa: E402
from mcpd.config import ModelConfig  # noqa: E402
from mcpd.models.loader import load_checkpoint  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TEXTS = ["Hello world", " leading  and double spaces ", "naïve café, 漢字 and 🙂", "line\nbreak\ttab"]


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bench") / "small"
    return checkpoints.write_checkpoint(directory, checkpoints.SMALL_SHAPE, checkpoints.byte_vocab(), torch.float32)


def test_issue_shape_has_the_issues_parameter_counts():
    shape = checkpoints.ISSUE_SHAPE
    assert shape.head_dim == 64
    assert round(shape.parameters / 1e6, 1) == 55.3
    assert shape.matmul_parameters * 4 == 155_713_536   # fp32 bytes a batch-1 decode step reads


def test_mcpd_loads_the_checkpoint_with_every_weight(small_checkpoint):
    loaded = load_checkpoint(ModelConfig(path=str(small_checkpoint)), torch.device("cpu"))
    assert sum(p.numel() for p in loaded.model.parameters()) == checkpoints.SMALL_SHAPE.parameters
    assert loaded.vocab_size == 32000 and loaded.tokenizer.eos_token_ids == {2} and loaded.tokenizer.bos_token_id == 1
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[INST] hi [/INST]"


def test_byte_vocab_round_trips_one_token_per_byte(small_checkpoint):
    loaded = load_checkpoint(ModelConfig(path=str(small_checkpoint)), torch.device("cpu"))
    for text in TEXTS:
        ids = loaded.tokenizer.encode(text)
        assert ids[:2] == [1, 259] and len(ids) == 2 + len(text.encode())
        assert loaded.tokenizer.decode(ids) == text


def test_transformers_reads_the_same_ids_as_mcpd(small_checkpoint):
    """vLLM tokenizes with transformers' AutoTokenizer: both servers must see the same prompt."""
    ours = load_checkpoint(ModelConfig(path=str(small_checkpoint)), torch.device("cpu")).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(small_checkpoint)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.encode(text)
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    turn = [{"role": "user", "content": "three"}]
    # A context appends each turn's own rendering; a stateless server renders the whole history:
    # W3 compares the two only because they are the same text.
    whole = theirs.apply_chat_template(history + turn, tokenize=False, add_generation_prompt=True)
    assert whole == ours.apply_chat_template(history[:1]) + " two " + ours.apply_chat_template(turn)


def sentencepiece_bpe(text: str, vocab: checkpoints.Vocab) -> list[str]:
    """SentencePiece's BPE, the reference: merge the adjacent pair that makes the best-scoring piece."""
    score = {t: vocab.scores[i] for i, t in enumerate(vocab.tokens) if vocab.types[i] == checkpoints.NORMAL}
    pieces = list("\u2581" + text.replace(" ", "\u2581"))
    while len(pieces) > 1:
        # the best-scoring pair; the leftmost of equals
        best = max(range(len(pieces) - 1), key=lambda i: (score.get(pieces[i] + pieces[i + 1], float("-inf")), -i))
        if pieces[best] + pieces[best + 1] not in score:
            break
        pieces[best:best + 2] = [pieces[best] + pieces[best + 1]]
    return pieces


def test_merges_rebuilt_from_scores_tokenize_as_sentencepiece():
    pieces = ["\u2581", "a", "b", "c", "ab", "bc", "abc", "\u2581a", "\u2581ab", "ca", "\u2581abc", "cab"]
    scores = [-1.0, -2.0, -3.0, -4.0, -5.0, -0.5, -6.0, -7.0, -0.2, -8.0, -9.0, -0.1]
    base = checkpoints.byte_vocab(259 + len(pieces))
    vocab = checkpoints.Vocab("test", base.tokens[:259] + pieces, [0.0] * 259 + scores,
                              base.types[:259] + [checkpoints.NORMAL] * len(pieces))
    tokenizer = checkpoints.tokenizer_for(vocab)
    for text in ["abc", "abcab", "cabc", "ab ab", "bcabca", "aabbcc abcabc", "cab cabab"]:
        assert tokenizer.encode(text, add_special_tokens=False).tokens == sentencepiece_bpe(text, vocab), text


def test_prompts_have_exact_token_counts_and_never_repeat(small_checkpoint):
    loaded = load_checkpoint(ModelConfig(path=str(small_checkpoint)), torch.device("cpu"))
    prompts = peers.Prompts(loaded.tokenizer)
    texts = [prompts.text(128) for _ in range(3)] + [prompts.text(160, "Turn ")]
    assert [len(loaded.tokenizer.encode(t)) for t in texts] == [128, 128, 128, 160]
    assert len({t[:12] for t in texts}) == 4   # each starts differently: no shared prefix to cache


def systems_with(given: dict[str, dict]) -> dict[str, dict]:
    """Each system's figures: 1.0 but those given."""
    return {name: {**dict.fromkeys(peers.FIGURES, 1.0), **figures} for name, figures in given.items()}


def test_ratios_point_to_mcpd_leading_above_one():
    systems = systems_with({"mcpd": {"w1_decode_tok_s": 100.0, "w1_ttft_ms": 50.0},
                            "vllm": {"w1_decode_tok_s": 150.0, "w1_ttft_ms": 25.0},
                            "llama.cpp": {"w1_decode_tok_s": 200.0, "w1_ttft_ms": 100.0}})
    ratios = peers.ratios_vs_best_peer(systems)
    assert ratios["w1_decode_tok_s_ratio_vs_best_peer"] == 0.5 and ratios["best_peer"]["w1_decode_tok_s"] == "llama.cpp"
    assert ratios["w1_ttft_ms_ratio_vs_best_peer"] == 0.5 and ratios["best_peer"]["w1_ttft_ms"] == "vllm"
    assert peers.ratios_vs_best_peer({"mcpd": systems["mcpd"]}) == {}


def test_a_keep_is_set_against_the_peer_that_leads_the_workload_idle():
    """A slow peer keeps most of its rate beside a busy core; the keep that counts is the fast one's."""
    systems = systems_with({"mcpd": {"w2_8_tok_s": 700.0, "w2_8_contention_keep_frac": 0.667},
                            "vllm": {"w2_8_tok_s": 440.0, "w2_8_contention_keep_frac": 0.295},
                            "llama.cpp": {"w2_8_tok_s": 96.0, "w2_8_contention_keep_frac": 0.872}})
    ratios = peers.ratios_vs_best_peer(systems)
    assert ratios["best_peer"]["w2_8_contention_keep_frac"] == "vllm"
    assert ratios["w2_8_contention_keep_frac_ratio_vs_best_peer"] == 0.667 / 0.295
    assert ratios["best_peer"]["w2_8_tok_s"] == "vllm"


def test_trained_checkpoint_is_the_same_for_the_same_recipe_and_cached_by_it(tmp_path):
    """bench/quantized.py's trained checkpoint: two trainings from scratch give the same weights
    (its quality figures are reproducible), a second call loads the first's, and another recipe
    trains another; mcpd loads it as any checkpoint."""
    recipe = trained.Recipe(steps=3, batch=2, window=16, warmup=1)
    assert trained.checkpoint(recipe, tmp_path / "a", checkpoints.SMALL_SHAPE, may_train=False) is None   # --quick
    first = trained.checkpoint(recipe, tmp_path / "a", checkpoints.SMALL_SHAPE)
    again = trained.checkpoint(recipe, tmp_path / "b", checkpoints.SMALL_SHAPE)
    weights = load_file(str(first / "model.safetensors"))
    assert first.name == again.name and weights.keys() == load_file(str(again / "model.safetensors")).keys()
    assert all(torch.equal(t, load_file(str(again / "model.safetensors"))[n]) for n, t in weights.items())
    base = load_file(str(first.with_name(first.name.split("-trained-")[0]) / "model.safetensors"))
    assert not torch.equal(weights["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"])
    written = (first / "training.json").stat().st_mtime_ns
    assert trained.checkpoint(recipe, tmp_path / "a", checkpoints.SMALL_SHAPE) == first
    assert trained.checkpoint(recipe, tmp_path / "a", checkpoints.SMALL_SHAPE, may_train=False) == first
    assert (first / "training.json").stat().st_mtime_ns == written
    other = trained.checkpoint(trained.Recipe(steps=2, batch=2, window=16, warmup=1), tmp_path / "a",
                               checkpoints.SMALL_SHAPE)
    assert other != first
    loaded = load_checkpoint(ModelConfig(path=str(first)), torch.device("cpu"))
    assert sum(p.numel() for p in loaded.model.parameters()) == checkpoints.SMALL_SHAPE.parameters

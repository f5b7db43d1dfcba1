"""The shipped text handlers in-process (mcpd/handlers/examples/): the tokenizer, the classifier
against transformers' own forward, the embedder's pooling, a batch's rows against the same rows
alone (padding must change nothing), and int8 (mcpd/handlers/int8.py) with its agreement."""
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
from transformers import BertForSequenceClassification, BertModel

from mcpd.config import load
from mcpd.handlers.batch_tensors import assemble
from mcpd.handlers.examples.bert_text import CHUNK_ROWS
from mcpd.handlers.examples.sentence_embedder import SentenceEmbedder
from mcpd.handlers.examples.text_classifier import TextClassifier
from mcpd.handlers.examples.wordpiece import PAD_ID, build_tokenizer, token_ids, vocabulary
from mcpd.handlers.handler import Handler
from mcpd.handlers.examples.risk_scorer import FEATURES, RiskScorer
from mcpd.handlers.int8 import agreement, quantize_handler, quantize_linear_int8
from mcpd.handlers.tensors import datatype_of
from mcpd.handlers.w8a8_linear import W8A8Linear

EXAMPLES = Path(__file__).resolve().parent.parent / "etc" / "examples" / "handlers.toml"
SETTINGS = {"layers": 2, "hidden": 64, "heads": 4, "max_length": 48, "seed": 3}


def texts(count: int, seed: int = 0) -> np.ndarray:
    """`count` texts of 1..40 made-up words, as the 1-D BYTES array a request carries."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(400)]
    array = np.empty(count, object)
    array[:] = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))).encode() for _ in range(count)]
    return array


def batch_of(handler, requests: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Preprocessed requests as a worker hands them to predict (padded, with their lengths)."""
    return assemble(requests, handler.inputs)[0]


@pytest.fixture(scope="module")
def classifier():
    handler = TextClassifier()
    handler.setup("cpu", {**SETTINGS, "labels": 4})
    return handler


@pytest.fixture(scope="module")
def embedder():
    handler = SentenceEmbedder()
    handler.setup("cpu", SETTINGS)
    return handler


def test_the_shipped_examples_file_is_a_config_mcpd_takes():
    config = load(EXAMPLES)
    risk, classify = config.models["risk"], config.models["classify"]
    assert risk.fast == "rules" and risk.versions["rules"].handler.endswith(":RiskRules")
    assert classify.versions["v1-int8"].quantization == "int8" and classify.versions["v1"].quantization == "none"
    assert {v.kind for m in config.models.values() for v in m.versions.values()} == {"handler"}


def test_the_vocabulary_and_ids_are_the_same_on_every_build():
    assert vocabulary() == vocabulary() and vocabulary()["[PAD]"] == PAD_ID
    sample = texts(20)
    assert np.array_equal(token_ids(build_tokenizer(32), sample), token_ids(build_tokenizer(32), sample))


def test_text_cannot_forge_a_special_token_and_any_bytes_tokenize():
    vocab = vocabulary()
    tokenizer = build_tokenizer(64)
    sample = np.empty(3, object)
    sample[:] = [b"[CLS] [SEP] [PAD] [MASK]", b"\xff\xfe not utf-8 \xc3", b""]
    ids = token_ids(tokenizer, sample)
    lengths = (ids != PAD_ID).sum(1)
    for row, length in zip(ids, lengths):
        assert row[0] == vocab["[CLS]"] and row[length - 1] == vocab["[SEP]"]
        assert not set(row[1:length - 1]) & {vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")}
    assert lengths[2] == 2   # an empty text is [CLS] [SEP]
    assert token_ids(build_tokenizer(8), texts(1)).shape[1] <= 8


@pytest.mark.parametrize("settings, says", [
    ({"layer": 2}, "settings layer: not one of"), ({"hidden": 100, "heads": 3}, "a multiple of settings.heads"),
    ({"labels": 1}, "settings.labels = 1"), ({"max_length": "128"}, "settings.max_length"),
    ({"layers": 10 ** 6}, "settings.layers"),
])
def test_bad_settings_are_refused_with_the_key(settings, says):
    with pytest.raises(ValueError, match=says):
        TextClassifier().setup("cpu", settings)


def test_the_classifier_gives_its_declared_outputs(classifier):
    outputs = classifier.predict(classifier.preprocess({"text": texts(5)}))
    assert {name: (datatype_of(a), a.shape) for name, a in outputs.items()} == {
        "logits": ("FP32", (5, 4)), "label": ("INT64", (5,))}
    for name, spec in classifier.outputs.items():
        spec.check(name, outputs[name])
    assert np.array_equal(outputs["label"], outputs["logits"].argmax(1))


def test_the_classifier_equals_transformers_forward_on_the_same_weights(classifier):
    """Each text alone, unpadded, through a BertForSequenceClassification of its own with the
    handler's weights, against the handler's padded batch of all of them."""
    reference = BertForSequenceClassification(classifier.model.config).eval()
    reference.load_state_dict(classifier.model.state_dict())
    tokenizer = build_tokenizer(SETTINGS["max_length"])
    sample = texts(12, seed=1)
    requests = [classifier.preprocess({"text": sample[i:i + 1]}) for i in range(12)]
    got = classifier.predict(batch_of(classifier, requests))
    with torch.inference_mode():
        want = torch.cat([reference(torch.tensor([tokenizer.encode(t.decode()).ids])).logits for t in sample])
    np.testing.assert_allclose(got["logits"], want.numpy(), rtol=1e-4, atol=1e-5)
    assert len(set(got["label"])) > 1   # texts spread over the labels: agreement below measures something


@pytest.mark.parametrize("fixture, output", [("classifier", "logits"), ("embedder", "embedding")])
def test_batched_rows_equal_each_row_alone(request, fixture, output):
    """Requests of different lengths in one batch (one of them of several rows), padded: each row's
    output is the one it gets alone."""
    handler = request.getfixturevalue(fixture)
    sample = texts(9, seed=2)
    requests = [handler.preprocess({"text": sample[i:j]}) for i, j in ((0, 1), (1, 5), (5, 6), (6, 9))]
    assert len({r["input_ids"].shape[1] for r in requests}) > 1
    batched = handler.predict(batch_of(handler, requests))[output]
    alone = np.concatenate([handler.predict(handler.preprocess({"text": sample[i:i + 1]}))[output] for i in range(9)])
    np.testing.assert_allclose(batched, alone, rtol=1e-4, atol=1e-5)


def test_a_request_of_many_rows_runs_in_chunks_and_none_is_answered_empty(classifier):
    """A request of more rows than max_batch_size runs alone: predict takes it CHUNK_ROWS at a
    time (bounded activations), each row still as it is alone."""
    sample = texts(2 * CHUNK_ROWS + 5, seed=7)
    whole = classifier.predict(classifier.preprocess({"text": sample}))["logits"]
    alone = [classifier.predict(classifier.preprocess({"text": sample[i:i + 1]}))["logits"] for i in range(len(sample))]
    np.testing.assert_allclose(whole, np.concatenate(alone), rtol=1e-4, atol=1e-5)
    empty = classifier.predict(classifier.preprocess({"text": np.empty(0, object)}))
    assert {name: (a.dtype, a.shape) for name, a in empty.items()} == {
        "logits": (np.float32, (0, 4)), "label": (np.int64, (0,))}


def test_the_embedding_is_the_normalised_mean_of_the_real_tokens(embedder):
    reference = BertModel(embedder.model.config, add_pooling_layer=False).eval()
    reference.load_state_dict(embedder.model.state_dict())
    sample = texts(6, seed=3)
    requests = [embedder.preprocess({"text": sample[i:i + 1]}) for i in range(6)]
    got = embedder.predict(batch_of(embedder, requests))["embedding"]
    tokenizer = build_tokenizer(SETTINGS["max_length"])
    with torch.inference_mode():
        means = torch.cat([reference(torch.tensor([tokenizer.encode(t.decode()).ids])).last_hidden_state.mean(1)
                           for t in sample])
    np.testing.assert_allclose(got, torch.nn.functional.normalize(means, dim=1).numpy(), rtol=1e-4, atol=1e-5)
    assert got.shape == (6, SETTINGS["hidden"]) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, rtol=1e-5)


def test_the_seed_decides_the_weights():
    sample = {"text": texts(3)}
    first, again, other = SentenceEmbedder(), SentenceEmbedder(), SentenceEmbedder()
    first.setup("cpu", SETTINGS)
    again.setup("cpu", SETTINGS)
    other.setup("cpu", {**SETTINGS, "seed": SETTINGS["seed"] + 1})
    run = [h.predict(h.preprocess(sample))["embedding"] for h in (first, again, other)]
    assert np.array_equal(run[0], run[1]) and not np.allclose(run[0], run[2])


def test_agreement_measures():
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32)
    assert agreement(logits, logits[:, ::-1], "top1") == 0.0
    assert agreement(logits, logits + [[0, 0], [0, 0], [0, 0], [0.5, 0]], "top1") == 1.0
    assert agreement(logits, np.array([[1, 0], [1, 0], [1, 0], [1, 0]], np.float32), "top1") == 0.5
    assert agreement(logits, 3 * logits, "cosine") == pytest.approx(1.0)
    assert agreement(logits, logits[:, ::-1], "cosine") < 0.9
    assert agreement(logits, logits + [[0, 0.25], [0, 0], [0, 0], [0, 0]], "max_abs_diff") == pytest.approx(0.25)
    with pytest.raises(ValueError, match="cannot be compared"):
        agreement(logits, logits[:3], "top1")


@pytest.mark.parametrize("force_int_mm, int8_linear", [(False, DynamicInt8Linear), (True, W8A8Linear)])
def test_int8_quantizes_every_linear_and_leaves_the_float_model_be(classifier, force_int_mm, int8_linear):
    """The CPU's torch dynamic int8, or (forced here, a CUDA device's) W8A8Linear."""
    weights = {name: p.clone() for name, p in classifier.model.named_parameters()}
    quantized = quantize_linear_int8(classifier.model, force_int_mm=force_int_mm)
    float_linears = sum(isinstance(m, torch.nn.Linear) for m in classifier.model.modules())
    assert float_linears == 2 * 6 + 2   # each layer's q, k, v, o, up, down; the pooler and the head
    assert sum(isinstance(m, int8_linear) for m in quantized.modules()) == float_linears
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert sum(isinstance(m, torch.nn.Linear) for m in classifier.model.modules()) == float_linears
    assert all(torch.equal(p, weights[name]) for name, p in classifier.model.named_parameters())


def test_int8_refuses_a_device_it_has_no_kernels_for_naming_it():
    with pytest.raises(ValueError, match="CUDA device .*; the model is on meta$"):
        quantize_linear_int8(torch.nn.Linear(4, 4, device="meta"))
    with pytest.raises(ValueError, match="the model is on cpu and meta$"):
        quantize_linear_int8(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, device="meta")))


def test_an_int8_handler_predicts_with_its_quantized_model():
    handler = TextClassifier()
    handler.setup("cpu", {**SETTINGS, "labels": 4})
    sample = handler.preprocess({"text": texts(4)})
    float_logits = handler.predict(sample)["logits"]
    quantize_handler(handler)
    assert any(isinstance(m, DynamicInt8Linear) for m in handler.model.modules())
    int8_logits = handler.predict(sample)["logits"]
    assert not np.array_equal(int8_logits, float_logits) and np.allclose(int8_logits, float_logits, atol=0.5)
    with pytest.raises(ValueError, match="kept none in self.model"):
        quantize_handler(Handler())   # a handler without a torch model (a numpy rule table, say)


# Random weights leave many texts' top two logits within int8's noise of each other (a trained
# classifier's margins are far wider), and int8 quantizes every layer's input to 8 bits: the
# measured agreement below is what these models give; a broken quantizer (a wrong scale, a layer
# left out of its input) gives about 1 / labels. The risk scores spread over 0.05-0.91: int8
# moves the farthest of 1000 by under 0.02 (torch's dynamic int8; W8A8Linear's per-row scales
# half that), a wrong scale by tenths.
MIN_TOP1_INT8, MIN_COSINE_INT8, MAX_SCORE_DIFF_INT8 = 0.8, 0.99, 0.04


@pytest.fixture(scope="module")
def risk_scorer():
    handler = RiskScorer()
    handler.setup("cpu", {"seed": 3, "hidden": 64})
    return handler


@pytest.mark.parametrize("force_int_mm", [False, True], ids=["dynamic_int8", "w8a8_int_mm"])
def test_int8_agreement_over_generated_inputs(classifier, embedder, risk_scorer, force_int_mm, capsys):
    """Each example quantized as on the CPU, and as on a CUDA device (W8A8Linear, forced here)."""
    features = np.random.default_rng(4).normal(size=(1000, FEATURES)).astype(np.float32)
    figures = {}
    for handler, batch, output, measure in (
            (classifier, classifier.preprocess({"text": texts(300, seed=4)}), "logits", "top1"),
            (embedder, embedder.preprocess({"text": texts(300, seed=4)}), "embedding", "cosine"),
            (risk_scorer, {"features": features}, "score", "max_abs_diff")):
        float_model = handler.model
        reference = handler.predict(batch)[output]
        handler.model = quantize_linear_int8(float_model, force_int_mm=force_int_mm)
        try:
            figures[measure] = agreement(reference, handler.predict(batch)[output], measure)
        finally:
            handler.model = float_model
    with capsys.disabled():
        print(f"\nint8 agreement (force_int_mm={force_int_mm}) over 300 texts, 1000 risk rows: {figures}")
    assert figures["top1"] >= MIN_TOP1_INT8 and figures["cosine"] >= MIN_COSINE_INT8
    assert 0 < figures["max_abs_diff"] <= MAX_SCORE_DIFF_INT8


@pytest.mark.parametrize("fixture", ["classifier", "embedder"])
def test_predict_runs_a_traced_graph_not_transformers_python(request, fixture):
    """transformers' Python costs about as much per call as a small model's compute: a batch
    runs the graph traced at setup, so no module of the model is called from Python (their
    hooks never fire), and a batch of one unpadded row still equals transformers' forward."""
    handler = request.getfixturevalue(fixture)
    called = []
    hooks = [module.register_forward_pre_hook(lambda module, args: called.append(module))
             for module in handler.model.modules()]
    try:
        outputs = handler.predict(batch_of(handler, [handler.preprocess({"text": texts(3, seed=5)}),
                                                     handler.preprocess({"text": texts(1, seed=6)})]))
    finally:
        for hook in hooks:
            hook.remove()
    assert called == [] and len(next(iter(outputs.values()))) == 4
    ids = torch.tensor(handler.preprocess({"text": texts(1, seed=8)})["input_ids"])
    with torch.inference_mode():
        untraced = handler.forward(ids, torch.ones_like(ids))
    for name, array in handler.predict({"input_ids": ids.numpy()}).items():
        np.testing.assert_array_equal(array, untraced[name].numpy())

"""quantization = "int8" for handler models on a GPU (skipped where torch sees none; CI has none):
W8A8Linear on CUDA (torch._int_mm on the tensor cores) gives what its CPU twin gives,
quantize_linear_int8 picks it for a model on CUDA, and int8 handler versions serve through the
real daemon on workers.device = "cuda"."""
import copy

import numpy as np
import pytest
import torch

from mcpd.handlers.examples.risk_scorer import FEATURES, RiskScorer
from mcpd.handlers.examples.text_classifier import TextClassifier
from mcpd.handlers.int8 import agreement, quantize_linear_int8
from mcpd.handlers.w8a8_linear import W8A8Linear
from test_handler_examples import MAX_SCORE_DIFF_INT8, MIN_TOP1_INT8, texts
from test_handler_examples_daemon import versions
from test_w8a8_linear import SHAPES, int8_error_bound, float_reference, linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")

# Both devices quantize with the same exact float ops (max, an IEEE division, round half to even)
# into the same int8 values, and sum them exactly in int32: only the float32 scaling after the sum
# could round differently, by an ulp or two of an output. 8 ulps of the largest output allows it.
TWIN_ULPS = 8 * torch.finfo(torch.float32).eps
SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
CLASSIFIER = "mcpd.handlers.examples.text_classifier:TextClassifier"
RISK_SETTINGS = {"seed": 3, "hidden": 64}
CLASSIFY_SETTINGS = {"layers": 2, "hidden": 128, "heads": 4, "labels": 4, "max_length": 128, "seed": 0}


@pytest.mark.parametrize("rows, in_features, out_features, bias", SHAPES)
def test_the_cuda_linear_gives_its_cpu_twins_outputs(rows, in_features, out_features, bias):
    layer = linear(in_features, out_features, bias)
    x = torch.randn(*rows, in_features) * torch.rand(*rows, 1) * 10
    on_cpu, on_cuda = W8A8Linear(layer), W8A8Linear(copy.deepcopy(layer).cuda())
    assert on_cuda.values.is_cuda
    assert torch.equal(on_cuda.values.cpu(), on_cpu.values) and torch.equal(on_cuda.weight_scale.cpu(), on_cpu.weight_scale)
    twin = on_cpu(x)
    torch.testing.assert_close(on_cuda(x.cuda()).cpu(), twin, rtol=TWIN_ULPS, atol=TWIN_ULPS * float(twin.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_cuda_linear_answers_in_its_dtype_within_int8s_error(dtype):
    layer = linear(200, 48).to(dtype)
    x = torch.randn(5, 7, 200, dtype=dtype)
    y = W8A8Linear(copy.deepcopy(layer).cuda())(x.cuda()).cpu()
    # The output's own rounding to dtype: half an ulp, under eps of it
    rounding = y.double().abs().reshape(-1, 48) * torch.finfo(dtype).eps
    error = (y.double() - float_reference(x, layer)).reshape(-1, 48).abs()
    assert y.dtype == dtype and bool((error <= int8_error_bound(x, layer) + rounding).all())


def test_a_model_on_cuda_gets_w8a8_linears_and_its_float_model_is_left_be():
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)).cuda()
    quantized = quantize_linear_int8(model)
    assert [type(m) for m in quantized] == [W8A8Linear, torch.nn.ReLU, W8A8Linear]
    assert all(m.values.is_cuda for m in quantized if isinstance(m, W8A8Linear))
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]


def risk_twin() -> RiskScorer:
    """The int8 risk version's handler as a CUDA worker runs it, on the CPU."""
    handler = RiskScorer()
    handler.setup("cpu", RISK_SETTINGS)
    handler.model = quantize_linear_int8(handler.model, force_int_mm=True)
    return handler


@pytest.mark.slow
def test_int8_handler_versions_serve_from_a_gpu_worker(fresh_daemon):
    d = fresh_daemon(**{
        "workers": {"device": "cuda"},
        "models.risk": {"default": "v1"},
        "models.risk.versions.v1": {"handler": SCORER}, "models.risk.versions.v1.settings": RISK_SETTINGS,
        "models.risk.versions.v1-int8": {"handler": SCORER, "quantization": "int8"},
        "models.risk.versions.v1-int8.settings": RISK_SETTINGS,
        "models.classify": {"default": "v1-int8"},
        "models.classify.versions.v1-int8": {"handler": CLASSIFIER, "quantization": "int8"},
        "models.classify.versions.v1-int8.settings": CLASSIFY_SETTINGS})
    d.wait_until(lambda: all(v.get("signature") for v in versions(d)), timeout=120,
                 what="every version's worker up (its Hello carries its signature)")
    workers = {(w["served_model"], w["version"]): (w["device"].split(":")[0], w["quantization"])
               for w in d.status()["devices"]}
    assert workers == {("risk", "v1"): ("cuda", "none"), ("risk", "v1-int8"): ("cuda", "int8"),
                       ("classify", "v1-int8"): ("cuda", "int8")}
    client = d.client()
    features = np.random.default_rng(4).normal(size=(1000, FEATURES)).astype(np.float32)
    float_scores = client.infer("risk", {"features": features}, version="v1").outputs["score"]
    int8_scores = client.infer("risk", {"features": features}, version="v1-int8").outputs["score"]
    assert 0 < agreement(float_scores, int8_scores, "max_abs_diff") <= MAX_SCORE_DIFF_INT8
    # Two layers whose int8 values and sums are the twin's: the scores differ by float32's last bits
    np.testing.assert_allclose(int8_scores, risk_twin().predict({"features": features})["score"], atol=1e-5)
    # A BERT's float ops (softmax, layer norm, GELU) differ in their last bits between devices,
    # which moves some activations across an int8 rounding step: against the float model it is
    # held to the CPU's bar, not to its twin's last bits
    sample = texts(200, seed=6)
    reply = client.infer("classify", {"text": sample})
    reference = TextClassifier()
    reference.setup("cpu", CLASSIFY_SETTINGS)
    float_logits = reference.predict(reference.preprocess({"text": sample}))["logits"]
    assert reply.version == "v1-int8" and agreement(float_logits, reply.outputs["logits"], "top1") >= MIN_TOP1_INT8
    assert not np.array_equal(float_logits, reply.outputs["logits"])

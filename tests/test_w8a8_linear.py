"""W8A8Linear (mcpd/handlers/w8a8_linear.py), the int8 linear a CUDA device's handler models
get, run here on the CPU, its test twin (torch._int_mm runs on both): within int8's error of
the float linear for any rows and widths (padded to what torch._int_mm on CUDA takes and
sliced back), exact where the inputs are exactly int8 steps, and the same in a traced graph
for every batch size."""
import pytest
import torch

from mcpd.handlers.w8a8_linear import MAX_IN_FEATURES, W8A8Linear, quantized_rows

FLOAT32_EPS = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def int_mm_held_to_its_cuda_rules(monkeypatch):
    """torch._int_mm on the CPU takes any shape; on CUDA more than 16 rows and widths that are
    multiples of 8 (aten's _int_mm_out_cuda): the twin here must meet them too."""
    int_mm = torch._int_mm

    def checked(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        assert a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0, (a.shape, b.shape)
        return int_mm(a, b)
    monkeypatch.setattr(torch, "_int_mm", checked)


def linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias)


def int8_error_bound(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """The most each output of the int8 layer may differ from the float one, [rows, out].
    With x's row quantized in steps sx (|x - x̂| <= sx/2, rounding to nearest) and the weight's
    row in steps sw (|w - ŵ| <= sw/2):
        |x·w - x̂·ŵ| = |(x - x̂)·w + x̂·(w - ŵ)| <= sx/2 Σ|w| + sw/2 Σ|x̂|,  |x̂| <= |x| + sx/2.
    The int32 sum is exact; the float32 scaling after it rounds a few times, each within eps of
    the magnitudes summed, plus the bias's own rounding: 8 eps of Σ|x̂||ŵ| + |b| covers them."""
    x, w = x.reshape(-1, x.shape[-1]).double(), layer.weight.detach().double()
    sx, sw = x.abs().amax(1, keepdim=True) / 127, w.abs().amax(1, keepdim=True) / 127
    x_hat, w_hat = x.abs() + sx / 2, w.abs() + sw / 2
    rounding = sx / 2 * w.abs().sum(1) + x_hat.sum(1, keepdim=True) * (sw / 2).T
    bias = 0 if layer.bias is None else layer.bias.detach().double().abs()
    return rounding + 8 * FLOAT32_EPS * (x_hat @ w_hat.T + bias)


def float_reference(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.detach().double()
    return torch.nn.functional.linear(x.double(), layer.weight.detach().double(), bias)


# rows (a tuple: the leading dims), in_features, out_features, bias: one row and 17 (the fewest
# torch._int_mm takes on CUDA), widths that are not multiples of 8, a (batch, seq, hidden) input
SHAPES = [((1,), 13, 21, True), ((17,), 64, 24, False), ((16,), 8, 8, True), ((40,), 37, 1, True),
          ((2, 5), 40, 7, True), ((3, 1), 9, 130, False)]


@pytest.mark.parametrize("rows, in_features, out_features, bias", SHAPES)
def test_every_shape_is_within_int8s_error_of_the_float_linear(rows, in_features, out_features, bias):
    layer = linear(in_features, out_features, bias)
    x = torch.randn(*rows, in_features) * torch.rand(*rows, 1) * 10   # rows of different ranges
    y = W8A8Linear(layer)(x)
    assert y.shape == (*rows, out_features) and y.dtype == torch.float32
    error = (y.double() - float_reference(x, layer)).reshape(-1, out_features).abs()
    assert bool((error <= int8_error_bound(x, layer)).all()), (error - int8_error_bound(x, layer)).max()
    assert not torch.equal(y, layer(x))   # it is not the float layer answering


def test_a_zero_row_gives_the_bias_and_no_rows_give_no_rows():
    layer = linear(24, 10)
    x = torch.randn(5, 24)
    x[2] = 0
    y = W8A8Linear(layer)(x)
    assert torch.equal(y[2], layer.bias.detach()) and torch.isfinite(y).all()
    assert W8A8Linear(layer)(torch.zeros(0, 24)).shape == (0, 10)



@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_row_gives_non_finite_outputs_and_leaves_the_other_rows_be(bad):
    """As the float layer does: a NaN is never passed off as a finite answer (int8 has no NaN)."""
    layer = W8A8Linear(linear(24, 10))
    x = torch.randn(4, 24)
    clean = layer(x)
    x[1, 5] = bad
    y = layer(x)
    assert not torch.isfinite(y[1]).any()
    assert torch.equal(y[[0, 2, 3]], clean[[0, 2, 3]])


def test_inputs_and_weights_of_exact_int8_steps_come_back_exact():
    """Integer rows whose largest value is 127, scaled by powers of two, are int8 values times
    their scales with no rounding: whatever the padding, each output is the float product (sums
    under 19 * 127^2 < 2^19 in steps of 2^-4, plus an integer bias, fit float32's 24 bits)."""
    generator = torch.Generator().manual_seed(1)

    def exact_rows(rows: int, width: int) -> torch.Tensor:
        values = torch.randint(-127, 128, (rows, width), generator=generator).float()
        values[:, 0] = 127
        return values * 2.0 ** torch.randint(-2, 1, (rows, 1), generator=generator)

    layer = linear(19, 11)
    with torch.no_grad():
        layer.weight.copy_(exact_rows(11, 19))
        layer.bias.copy_(torch.arange(11.0))
    x = exact_rows(3, 19)
    assert torch.equal(W8A8Linear(layer)(x).double(), float_reference(x, layer))


def test_rows_quantize_to_the_nearest_step_in_the_symmetric_range():
    matrix = torch.randn(6, 50) * torch.tensor([[1e-3], [1.0], [50.0], [0.0], [7.0], [1e4]])
    values, scale = quantized_rows(matrix)
    assert values.dtype == torch.int8 and int(values.abs().max()) == 127 and int(values.min()) >= -127
    assert (values[3] == 0).all() and bool((values.abs().amax(1) == 127).sum() == 5)
    assert bool(((matrix - values.float() * scale).abs() <= scale / 2 * (1 + 1e-6)).all())


def test_weights_are_padded_to_multiples_of_8_with_zeros_and_the_float_layer_is_left_be():
    layer = linear(13, 5)
    before = layer.weight.detach().clone()
    quantized = W8A8Linear(layer)
    assert quantized.values.shape == (8, 16) and quantized.values.is_contiguous()
    assert not quantized.values[5:].any() and not quantized.values[:, 13:].any()
    assert torch.equal(layer.weight, before) and layer.weight.dtype == torch.float32


@pytest.mark.filterwarnings("ignore:.*is deprecated", "ignore::torch.jit.TracerWarning")
def test_a_traced_graph_takes_any_batch_and_a_wrong_width_is_refused():
    """A handler's model runs as a graph traced on one example: the padding to torch._int_mm's
    fewest rows must not be fixed to the example's rows."""
    model = torch.nn.Sequential(W8A8Linear(linear(12, 20)), torch.nn.ReLU(), W8A8Linear(linear(20, 3))).eval()
    with torch.inference_mode():
        graph = torch.jit.freeze(torch.jit.trace(model, (torch.randn(2, 4, 12),)))
        for shape in [(1, 1, 12), (5, 7, 12), (30, 1, 12), (0, 3, 12)]:
            x = torch.randn(*shape)
            assert torch.equal(graph(x), model(x))
    with pytest.raises((RuntimeError, AssertionError)):
        model(torch.randn(3, 13))


def test_bfloat16_in_bfloat16_out_and_a_too_wide_layer_is_refused():
    layer = linear(32, 16).to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    y = W8A8Linear(layer)(x)
    bound = int8_error_bound(x, layer) + y.double().abs() * 2 ** -8   # bfloat16's own rounding of y
    assert y.dtype == torch.bfloat16 and bool(((y.double() - float_reference(x, layer)).abs() <= bound).all())
    with pytest.raises(ValueError, match="overflow its int32 sums"):
        W8A8Linear(torch.nn.Linear(MAX_IN_FEATURES + 1, 1, device="meta"))

"""GGUF's quantized blocks kept as they are: Q4_0, Q4_1, Q4_K and Q6_K as 4-bit weights (quant/int4.py,
Q6_K's with their top two bits beside), Q8_0 and Q5_0 as int8 in groups of 32 (quant/int8.py), a
matrix of parts in different ones as one (kernels/row_parts.py). Their weights are the gguf package's dequantized ones bit
for bit, and every kernel set (each native set this CPU runs, and the torch twin) multiplies by
them as the float product of those weights does, in float32 to float32 rounding (only the order
of sums differs), in bfloat16 to a bfloat16 step of each row's largest value: int8 weights by x
itself, 4-bit ones by x quantized to int16 blocks (activations_q16)."""
import gguf
import numpy as np
import pytest
import torch

from mcpd.kernels.forms import rebuilt, tensors_of
from mcpd.kernels.native_kernels import NativeKernels
from mcpd.kernels.row_parts import RowParts
from mcpd.kernels.torch_kernels import TorchKernels
from mcpd.models import gguf_blocks
from mcpd.quant import activations_q16, int4, int8
from mcpd.quant.int4 import Int4Weight
from mcpd.quant.int4_layout import HIGHS_SUFFIX, MINS_SUFFIX, SCALES_SUFFIX, SUPERS_SUFFIX
from mcpd.quant.int8 import Int8Weight
from mcpd.quant.int8_layout import SCALE_SUFFIX
from k_quants import QUANTIZERS
from kernel_sets import NATIVE_SETS

KERNELS = {**{name: NativeKernels(name.removeprefix("native-")) for name in NATIVE_SETS}, "torch": TorchKernels()}
TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0", "Q5_0")
INT8_TYPES = ("Q8_0", "Q5_0")
COLUMNS = {"Q4_K": 512, "Q6_K": 512}   # inputs of the test matrices: two super-blocks of 256; the others 96, three blocks


def gguf_weights(rows: int, qtype: str, seed: int = 0, columns: int | None = None) -> tuple[object, torch.Tensor]:
    """(the form a GGUF's `qtype` tensor of random weights is kept in, the gguf package's
    dequantized weights float32 [rows, columns or COLUMNS])."""
    columns = columns or COLUMNS.get(qtype, 96)
    weights = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = QUANTIZERS[qtype](weights) if qtype in QUANTIZERS else gguf.quants.quantize(weights, kind)
    return kept_form(raw, qtype, rows), torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(rows, columns))


def kept_form(raw: np.ndarray, qtype: str, rows: int):
    pieces = {suffix: torch.from_numpy(np.ascontiguousarray(array))
              for suffix, array in gguf_blocks.pieces(raw, qtype, rows).items()}
    if qtype in INT8_TYPES:
        return Int8Weight(pieces[""], pieces[SCALE_SUFFIX])
    return Int4Weight(pieces[""], pieces[SCALES_SUFFIX], pieces.get(MINS_SUFFIX), pieces.get(SUPERS_SUFFIX),
                      pieces.get(HIGHS_SUFFIX))


def dequantized(weight) -> torch.Tensor:
    return int4.dequantize(weight) if isinstance(weight, Int4Weight) else int8.dequantize(weight.values, weight.scales)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_kept_weights_are_the_gguf_packages_dequantized_ones(qtype):
    weight, expected = gguf_weights(40, qtype)
    assert torch.equal(dequantized(weight), expected)


# (bytes a super-block, where its float16s lie): Q4_K's d and dmin first, Q6_K's d last
SUPER_BLOCKS = {"Q4_K": (144, slice(0, 4)), "Q6_K": (210, slice(208, 210))}


def random_k_quant_bytes(qtype: str, rows: int, supers: int, seed: int = 1) -> np.ndarray:
    """A `qtype` (Q4_K, Q6_K) matrix's bytes [rows, supers super-blocks], random but for finite float16s."""
    size, halves = SUPER_BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, supers, size), dtype=np.uint8)
    raw[:, :, halves] = rng.standard_normal((rows, supers, (halves.stop - halves.start) // 2)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", SUPER_BLOCKS)
@pytest.mark.parametrize("kernels", KERNELS)
def test_any_k_quant_bytes_are_kept_as_the_gguf_packages_dequantized_ones(kernels, qtype):
    """Every scale, min and top-bit pattern, not only those a quantizer writes: random bytes with
    finite float16s, on the torch twin and through each native set's rows."""
    rows = 40
    raw = random_k_quant_bytes(qtype, rows, 4)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(rows, -1))
    k = KERNELS[kernels]
    ids = torch.arange(rows)
    assert torch.equal(k.embedding(ids, k.prepare(kept_form(raw, qtype, rows)), torch.float32), expected)


def test_a_q8_0_block_of_negative_or_zero_scale_keeps_its_weights_with_a_positive_one():
    """llama.cpp's quantizer writes d >= 0; a file with d < 0 or d = 0 holds the same weights
    under the int8 form's positive scales (int8.bad_scales would refuse it otherwise)."""
    raw = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64),
                               gguf.GGMLQuantizationType.Q8_0)
    blocks = raw.reshape(1, 2, 34).copy()
    d = blocks[:, :, :2].view(np.float16)
    d[0, 0] = -d[0, 0]          # the first block's weights negated
    d[0, 1] = 0                 # the second's all zero
    expected = gguf.quants.dequantize(blocks.reshape(1, 68), gguf.GGMLQuantizationType.Q8_0)
    pieces = gguf_blocks.pieces(blocks.reshape(1, 68), "Q8_0", 1)
    assert (pieces[SCALE_SUFFIX] > 0).all()
    assert torch.equal(int8.dequantize(torch.from_numpy(pieces[""]), torch.from_numpy(pieces[SCALE_SUFFIX])),
                       torch.from_numpy(expected))


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kernels", KERNELS)
def test_products_are_the_dequantized_weights_float_product(kernels, qtype, dtype, rows):
    """40 outputs: two panels and a short one (padding rows). Q8_0 and Q5_0 take the int8 path,
    whose activations are rounded to int16 levels of their row's largest (activations_q16.int16_rows):
    half a level a weight more."""
    weight, expected_weights = gguf_weights(40, qtype, seed=rows)
    x = torch.randn(rows, expected_weights.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(7)).to(dtype)
    k = KERNELS[kernels]
    y = k.linear(x, k.prepare(weight), bias)
    x_taken = x if qtype in INT8_TYPES else activations_q16.quantized(x)
    expected = x_taken.double() @ expected_weights.double().T + bias.double()
    size = (x.double().abs() @ expected_weights.double().abs().T).amax(dim=-1, keepdim=True)
    level = x.double().abs().amax(dim=-1, keepdim=True) / activations_q16.INT16_LEVELS if qtype in INT8_TYPES else 0
    rounding = level / 2 * expected_weights.double().abs().sum(dim=1)
    assert y.dtype == dtype and y.shape == (rows, 40)
    assert ((y.double() - expected).abs() <= size * (1e-5 if dtype == torch.float32 else 2 ** -7) + rounding).all()


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("qtype", ("Q4_0", "Q4_1", "Q4_K", "Q6_K"))
@pytest.mark.parametrize("kernels", KERNELS)
def test_4_bit_products_take_x_in_int16_steps_of_each_blocks_largest(kernels, qtype, rows):
    """Values under half a step (max |x| / 32767) of their block's largest count as zero, on
    every set alike: x is rounded to int16 blocks of 32 (activations_q16) before the product."""
    weight, expected_weights = gguf_weights(40, qtype, seed=rows)
    x = torch.randn(rows, expected_weights.shape[1], generator=torch.Generator().manual_seed(rows))
    x[:, ::32] = 1000.0                     # each block's largest: a step of 1000 / 32767
    small = torch.zeros_like(x, dtype=torch.bool)
    small[:, 1::32] = True
    x[small] = 0.01                         # under half a step (0.0153)
    k = KERNELS[kernels]
    packed = k.prepare(weight)
    assert torch.equal(k.linear(x, packed), k.linear(x.masked_fill(small, 0.0), packed))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_matrix_in_parts_of_different_types_multiplies_as_one(kernels, dtype, rows):
    """A Q4_K_M's q/k/v: parts of 40 (Q4_K), 24 (Q6_K) and 20 (Q5_0) rows, one product, each
    part's columns (and bias) exactly its own product's, the whole the float product's."""
    parts = [gguf_weights(n, qtype, seed=n, columns=512) for n, qtype in ((40, "Q4_K"), (24, "Q6_K"), (20, "Q5_0"))]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(84, generator=torch.Generator().manual_seed(7)).to(dtype)
    k = KERNELS[kernels]
    prepared = [k.prepare(weight) for weight, _ in parts]
    y = k.linear(x, RowParts(tuple(prepared), (40, 24, 20)), bias)
    assert y.dtype == dtype and y.shape == (rows, 84)
    assert torch.equal(y, torch.cat([k.linear(x, part, b) for part, b in zip(prepared, bias.split((40, 24, 20)))], 1))
    weights = torch.cat([expected for _, expected in parts]).double()
    x_taken = activations_q16.quantized(x).double()   # by the 4-bit parts; the Q5_0 one (int8) takes x
    expected = torch.cat([x_taken @ weights[:64].T, x.double() @ weights[64:].T], 1) + bias.double()
    size = (x.double().abs() @ weights.abs().T).amax(dim=-1, keepdim=True)
    assert ((y.double() - expected).abs() <= size * (1e-5 if dtype == torch.float32 else 2 ** -7)).all()


ROW_COUNTS = range(2, 14)   # kernels.c's 4-bit tiles (AVX-512: 8 rows; AVX2: 4) and past them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ("Q4_0", "Q4_1", "Q4_K", "Q6_K"))
@pytest.mark.parametrize("kernels", NATIVE_SETS)
def test_4_bit_products_of_many_rows_are_the_same_bits_as_each_rows_alone(kernels, qtype, dtype):
    """One-token prompts batched into one step, and a prompt's rows, get the logits each gets alone."""
    weight, expected_weights = gguf_weights(40, qtype)
    x = torch.randn(max(ROW_COUNTS), expected_weights.shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
    k = KERNELS[kernels]
    packed = k.prepare(weight)
    for rows in ROW_COUNTS:
        batched = k.linear(x[:rows], packed)
        for row in range(rows):
            assert torch.equal(batched[row:row + 1], k.linear(x[row:row + 1], packed)), f"row {row} of {rows}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kernels", KERNELS)
def test_embedding_rows_of_a_kept_table_are_its_dequantized_rows(kernels, qtype, dtype):
    weight, expected = gguf_weights(40, qtype)
    ids = torch.tensor([0, 39, 17, 16, 15, 17])
    k = KERNELS[kernels]
    assert torch.equal(k.embedding(ids, k.prepare(weight), dtype), expected[ids].to(dtype))


@pytest.mark.parametrize("qtype", TYPES)
def test_a_meta_weight_is_prepared_as_a_real_one(qtype):
    """The device pool lays prepared weights out from meta tensors, before reading any."""
    weight, _ = gguf_weights(40, qtype)
    meta = rebuilt(weight, {f: torch.empty(t.shape, dtype=t.dtype, device="meta") for f, t in tensors_of(weight).items()})
    for k in KERNELS.values():
        real, laid_out = k.prepare(weight), k.prepare(meta)
        assert {f: (t.shape, t.dtype) for f, t in tensors_of(real).items()} == \
            {f: (t.shape, t.dtype) for f, t in tensors_of(laid_out).items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_non_finite_activation_makes_every_output_of_its_row_nan(kernels, qtype, dtype):
    """A NaN, inf or -inf in x gives NaN in every output of its row, as the float product of NaN
    does, not a block of x quantized around it (its int16 steps measured from the finite values,
    or from inf); the row beside them gets what it gets beside finite rows."""
    weight, expected_weights = gguf_weights(40, qtype)
    x = torch.randn(4, expected_weights.shape[1], generator=torch.Generator().manual_seed(5)).to(dtype)
    x[1, 33], x[2, 7], x[3, 70] = float("nan"), float("inf"), float("-inf")
    k = KERNELS[kernels]
    packed = k.prepare(weight)
    y = k.linear(x, packed)
    assert y[1:].isnan().all()
    assert torch.equal(y[0], k.linear(x.index_fill(0, torch.tensor([1, 2, 3]), 0.0), packed)[0])
    assert y[0].isfinite().all()

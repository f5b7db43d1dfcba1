"""The 4-bit products' Triton kernels (quant/int4_cuda.py) against the torch twin (int4.linear):
every form (Q4_0, Q4_1, Q4_K, Q6_K, and random K-quant bytes for every scale, min and top-bit
pattern), the rows kernel (1 and 2 rows) and the tile kernel (3 and 17), on a GPU where one is lent,
else through Triton's interpreter on this CPU in float32 (CI has no GPU: these are what it holds,
with the kernels compiled for one). bfloat16 and float16 run on a GPU only: the interpreter
multiplies bfloat16 dot operands as raw bits (tests/test_decode_step.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPU = torch.cuda.is_available()
if not GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is off (tests/conftest.py turns it on)", allow_module_level=True)
triton = pytest.importorskip("triton")

from mcpd.kernels.torch_kernels import TorchKernels  # noqa: E402
from mcpd.quant import activations_q16, int4, int4_cuda  # noqa: E402
from mcpd.quant.int4 import Int4Weight  # noqa: E402
from mcpd.quant.int4_layout import BLOCK  # noqa: E402
from mcpd.quant.int8_cuda import ROWS_KERNEL_MAX  # noqa: E402
from test_int4 import gguf_weights, kept_form, random_k_quant_bytes  # noqa: E402

DEVICE = torch.device("cuda" if GPU else "cpu")
needs_cuda = pytest.mark.skipif(not GPU, reason="no CUDA device here (CI has none)")
N, K = 75, 1280   # outputs not a multiple of any tile; five super-blocks, past the rows kernel's 1024 columns a step
FORMS = ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q4_K bytes", "Q6_K bytes")   # "bytes": random, not a quantizer's
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_cuda), pytest.param(torch.float16, marks=needs_cuda)]


def weight_of(form: str, seed: int) -> Int4Weight:
    if form.endswith(" bytes"):
        qtype = form.removesuffix(" bytes")
        weight = kept_form(random_k_quant_bytes(qtype, N, K // 256, seed), qtype, N)
    else:
        weight, _ = gguf_weights(N, form, seed, columns=K)
    return Int4Weight(*(None if t is None else t.to(DEVICE) for t in (weight.values, weight.scales, weight.mins,
                                                                        weight.supers, weight.highs)))


def bound(x: torch.Tensor, weight: Int4Weight, twin: torch.Tensor) -> torch.Tensor:
    """How far the kernels may be from the twin (int4_cuda's doc): the twin's x is rounded to
    int16 blocks (a step each, of its block's largest / 32767), the kernels' sums are ordered
    otherwise, and the tile kernel rounds its weights to the dot's type on a GPU (TF32 rounds x
    too: 2^-10 of a product); both round the float32 sum to x's dtype, a step of it apart at most."""
    rows = x.reshape(-1, x.shape[-1]).float()
    w = int4.dequantize(weight).abs()
    steps = rows.abs().unflatten(-1, (-1, BLOCK)).amax(-1, keepdim=True).expand(-1, -1, BLOCK).flatten(1)
    tiled = GPU and rows.shape[0] > ROWS_KERNEL_MAX
    rounding = {torch.float32: 2 ** -10, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -8}[x.dtype] if tiled else 2 ** -16
    error = (steps / activations_q16.INT16_LEVELS) @ w.T + rounding * (rows.abs() @ w.T)
    return error.view(twin.shape) + torch.finfo(x.dtype).eps * twin.float().abs() + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 17])   # the rows kernel, its most, the tile kernel, past a tile of 16
@pytest.mark.parametrize("form", FORMS)
def test_the_kernels_multiply_as_the_twin(form, rows, dtype):
    weight = weight_of(form, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    spread = int4.dequantize(weight).square().mean().sqrt().item()   # random bytes' weights reach 10^4
    x = (torch.randn(rows, K, generator=generator) / spread).to(DEVICE, dtype)   # y within float16's range
    bias = torch.randn(N, generator=generator).to(DEVICE, dtype)
    y, twin = int4_cuda.linear(x, weight, bias), int4.linear(x, weight, bias)
    assert y.dtype == dtype and y.shape == (rows, N)
    assert bool(((y.float() - twin.float()).abs() <= bound(x, weight, twin)).all())


@pytest.mark.parametrize("rows", [2, 3])   # each kernel, for x[0]
@pytest.mark.parametrize("form", ("Q4_1", "Q6_K"))
def test_the_kernels_take_leading_dimensions_strided_rows_and_no_bias(form, rows):
    weight = weight_of(form, seed=5)
    x = torch.randn(2, rows, K, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
    y = int4_cuda.linear(x, weight)
    assert y.shape == (2, rows, N)
    assert bool(((y - int4.linear(x, weight)).abs() <= bound(x, weight, y)).all())
    alone = int4_cuda.linear(x[0], weight)
    wide = torch.zeros(rows, 3 * K, device=DEVICE)
    wide[:, :K], wide[:, K::2] = x[0], x[0]
    assert torch.equal(int4_cuda.linear(wide[:, :K], weight), alone)     # rows 3k apart: read where they lie
    assert torch.equal(int4_cuda.linear(wide[:, K::2], weight), alone)   # columns two apart: copied first
    assert int4_cuda.linear(x[:, :0], weight).shape == (2, 0, N)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 5])
def test_the_torch_kernels_send_a_4_bit_product_on_a_gpu_to_the_kernels(rows):
    weight = weight_of("Q4_K", seed=rows)
    x = torch.randn(rows, K, device=DEVICE, dtype=torch.bfloat16)
    assert torch.equal(TorchKernels().linear(x, weight), int4_cuda.linear(x, weight))
    assert torch.equal(TorchKernels().logits(x, weight), int4_cuda.linear(x, weight).float())


@pytest.mark.parametrize("form", FORMS)
def test_the_kernels_weights_are_the_twins_bit_for_bit(form):
    """A row of the identity picks a column of w: its one nonzero product is exact, so y is that
    column's weights as the kernel forms them, which are int4.dequantize's to the bit; every
    position of the first and the last block (another super-block), of 8 outputs (the
    interpreter is slow), through the rows kernel two at a time and the tile kernel all at once
    (in the interpreter only: on a GPU its dot rounds a float32 w to TF32)."""
    full = weight_of(form, seed=9)
    weight = Int4Weight(*(None if t is None else t[:8] for t in (full.values, full.scales, full.mins, full.supers,
                                                                  full.highs)))
    picked = [*range(BLOCK), *range(K - BLOCK, K)]
    identity = torch.eye(K, device=DEVICE)[picked]
    expected = int4.dequantize(weight).T[picked]
    for pair in range(0, len(picked), 2):
        assert torch.equal(int4_cuda.linear(identity[pair:pair + 2], weight), expected[pair:pair + 2]), picked[pair]
    if not GPU:
        assert torch.equal(int4_cuda.linear(identity, weight), expected)


# Each form's kernels compiled for an H200 (sm_90), by a process without the interpreter.
COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mcpd.quant import int4_cuda as kernels
SCALES_AND_MINS = {kernels.Q4_0: ("fp16", "u8"), kernels.Q4_1: ("fp16", "fp16"), kernels.Q4_K: ("u8", "u8"),
                   kernels.Q6_K: ("i8", "u8")}
INTEGERS = ("M", "N", "K", "x_row_stride", "y_row_stride", "values_stride", "scales_stride", "mins_stride",
            "supers_stride", "supers_step", "highs_stride")
ROWS, TILE = (kernels._rows_product, kernels.ROWS_TILE), (kernels._tile_product, dict(kernels.TILES[-1][1], BLOCK_K=kernels.TILE_K))
for (kernel, tile), form, x in [*((k, f, "bf16") for k in (ROWS, TILE) for f in SCALES_AND_MINS), (TILE, kernels.Q6_K, "fp32")]:
    scales, mins = SCALES_AND_MINS[form]
    constants = dict(FORM=form, HAS_BIAS=True, **{k: v for k, v in tile.items() if k.isupper()})
    signature = (dict(x="*" + x, values="*u8", scales="*" + scales, mins="*" + mins, supers="*fp16", highs="*u8",
                      bias="*" + x, y="*" + x) | dict.fromkeys(INTEGERS, "i32") | dict.fromkeys(constants, "constexpr"))
    names = list(signature)
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={k: v for k, v in tile.items() if not k.isupper()})
"""


def test_the_kernels_compile_for_a_gpu():
    """The interpreter runs what the compiler may refuse (a dot's K under 16, say): each form's
    kernels for bfloat16 x, and the tile kernel's TF32 dot, compiled to an H200's machine code
    (Triton's own ptxas) where CI has no GPU."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no ptxas")
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

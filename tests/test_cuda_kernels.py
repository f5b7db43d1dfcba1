"""The CUDA kernels in Triton (kernels/cuda_kernels.py) against their torch twins, on a GPU (CI has
none: run where one is lent). Paged decode attention: every dtype, block size, group of query
heads per KV head, context lengths around the kernel's tile of TOKENS, tables padded by junk
blocks, batches small enough to split each context among programs and large enough not to. The
fused ops (add_rms_norm, rope_store, silu_mul, attention_inputs): float32 to float32's last bits,
16-bit types within one rounding (the order of a row's sum and exp's last bit may differ from
torch's)."""
import pytest
import torch

from mcpd.kernels.torch_kernels import TORCH
from mcpd.models.layers import AttentionGroup, RotaryEmbedding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("copies", [1, 40])   # 6 sequences: contexts split among programs; 240: not
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [(16, 8, 2, 64), (1, 4, 4, 16), (8, 32, 4, 128),
                                                                   (32, 12, 12, 64), (16, 28, 4, 128)])
def test_paged_decode_attention_matches_the_torch_twin(dtype, copies, block_size, heads, kv_heads, head_dim):
    from mcpd.kernels.cuda_kernels import TOKENS, decode_attention, split_count
    generator = torch.Generator().manual_seed(block_size * heads + head_dim)
    lengths = [1, TOKENS - 1, TOKENS, TOKENS + 1, 3 * TOKENS + 5, 7] * copies
    assert (split_count(len(lengths) * kv_heads, torch.device("cuda")) > 1) == (copies == 1)
    widths = [-(-n // block_size) for n in lengths]
    num_blocks = sum(widths) + 3
    cache = torch.randn(num_blocks, 3, 2, block_size, kv_heads, head_dim, generator=generator).to(dtype).cuda()
    layer = cache[:, 1]   # a layer's view: blocks are strided by all layers
    order = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.full((len(lengths), max(widths) + 2), order[-1])   # junk past each length
    taken = 0
    for row, width in enumerate(widths):
        table[row, :width] = torch.tensor(order[taken:taken + width])
        taken += width
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype).cuda()
    group = AttentionGroup(0, len(lengths), table.cuda(), torch.tensor(lengths).cuda())
    expected = TORCH.decode_attention(q.float(), layer.float(), group, head_dim ** -0.5)
    out = decode_attention(q, layer, group.block_table, group.context_lens, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == (len(lengths), heads * head_dim)
    assert (out.float() - expected).abs().max().item() < TOLERANCE[dtype]


def close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:   # within two roundings of the 16-bit type (a normalised value, then its product by the weight)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -6, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, size", [(1, 2048), (7, 96), (300, 5000)])
def test_add_rms_norm_matches_the_torch_twin(dtype, rows, size):
    from mcpd.kernels.cuda_kernels import CudaKernels
    generator = torch.Generator().manual_seed(rows)
    residual, delta = (torch.randn(rows, size, generator=generator).to(dtype).cuda() for _ in range(2))
    weight = torch.randn(size, generator=generator).to(dtype).cuda()
    for extra in (delta, None):
        expected = TORCH.add_rms_norm(residual.clone(), extra, weight, 1e-5)
        out = CudaKernels().add_rms_norm(residual.clone(), extra, weight, 1e-5)
        close(out[0], expected[0])
        close(out[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 5632), (33, 100)])
def test_silu_mul_matches_the_torch_twin(dtype, rows, inter):
    from mcpd.kernels.cuda_kernels import CudaKernels
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(dtype).cuda()
    close(CudaKernels().silu_mul(gate_up), TORCH.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(8, 2, 64, 16), (32, 4, 128, 1), (4, 4, 16, 8)])
def test_rope_store_matches_the_torch_twin(dtype, heads, kv_heads, head_dim, block_size):
    from mcpd.kernels.cuda_kernels import CudaKernels
    generator = torch.Generator().manual_seed(heads + head_dim)
    rows = 9
    table = RotaryEmbedding(head_dim, 10000.0, None, torch.device("cuda")).table(512, dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype).cuda()
    positions = torch.randint(0, 512, (rows,), generator=generator).cuda()
    slots = torch.randperm(12 * block_size, generator=generator)[:rows].cuda()
    caches = [torch.zeros(12, 3, 2, block_size, kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2)]
    arguments = (heads, kv_heads, head_dim, table, positions, slots // block_size, slots % block_size)
    expected = TORCH.rope_store(qkv, *arguments, caches[0][:, 2])
    out = CudaKernels().rope_store(qkv, *arguments, caches[1][:, 2])
    close(out, expected)
    close(caches[1], caches[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("outputs, inputs", [(2560, 2048), (2048, 5632), (40, 96), (8192, 64)])
def test_one_row_products_match_torch(dtype, outputs, inputs):
    """One row by a 16-bit matrix runs the Triton product (sums in another order: within a
    rounding); two rows, a bias, float32 or a larger matrix stay torch's, exactly."""
    from mcpd.kernels.cuda_kernels import ROW_PRODUCT_MOST_OUTPUTS, CudaKernels
    generator = torch.Generator().manual_seed(outputs)
    weight = (torch.randn(outputs, inputs, generator=generator) * 0.02).to(dtype).cuda()
    x = torch.randn(2, inputs, generator=generator).to(dtype).cuda()
    kernels = CudaKernels()
    close(kernels.linear(x[:1], weight), torch.nn.functional.linear(x[:1], weight))
    assert torch.equal(kernels.linear(x, weight), torch.nn.functional.linear(x, weight))
    bias = torch.randn(outputs, generator=generator).to(dtype).cuda()
    assert torch.equal(kernels.linear(x[:1], weight, bias), torch.nn.functional.linear(x[:1], weight, bias))
    assert torch.equal(kernels.linear(x[:1].float(), weight.float()),
                       torch.nn.functional.linear(x[:1].float(), weight.float()))
    wide = torch.cat([weight] * (ROW_PRODUCT_MOST_OUTPUTS // outputs + 1))
    assert torch.equal(kernels.linear(x[:1], wide), torch.nn.functional.linear(x[:1], wide))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, hidden", [(32, 4, 64, 2048), (4, 4, 16, 96), (8, 2, 128, 3000)])
def test_attention_inputs_of_one_row_match_the_unfused_ops(dtype, heads, kv_heads, head_dim, hidden):
    """attention_inputs at one row is one kernel: the norm's scale from the whole row, each input
    value rounded as add_rms_norm rounds it, the product, then rope_store's rotation and stores. The
    residual's sum comes out of place, the old one untouched. Two rows take the unfused ops."""
    from mcpd.kernels.cuda_kernels import CudaKernels
    generator = torch.Generator().manual_seed(heads + hidden)
    residual, delta = (torch.randn(2, hidden, generator=generator).to(dtype).cuda() for _ in range(2))
    norm_weight = torch.randn(hidden, generator=generator).to(dtype).cuda()
    weight = (torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=generator) * 0.02).to(dtype).cuda()
    table = RotaryEmbedding(head_dim, 10000.0, None, torch.device("cuda")).table(512, dtype)
    positions, slots = torch.tensor([300, 7]).cuda(), torch.tensor([13, 2]).cuda()
    caches = [torch.zeros(12, 3, 2, 4, kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2)]

    def both(rows, extra):
        arguments = (norm_weight, 1e-5, weight, None, heads, kv_heads, head_dim, table, positions[:rows],
                     slots[:rows] // 4, slots[:rows] % 4)
        before = residual[:rows].clone()
        out = CudaKernels().attention_inputs(residual[:rows].clone(), extra, *arguments, caches[0][:, 1])
        return out, TORCH.attention_inputs(before, extra, *arguments, caches[1][:, 1])
    kept = residual[:1].clone()
    for rows, extra in ((1, delta[:1]), (1, None), (2, delta)):
        (summed, q), expected = both(rows, extra)
        close(summed, expected[0])
        # A rotated value is a difference of products: a rounding apart in the q/k/v product's
        # output (~1 here) is that far apart however small the difference comes out.
        for out, twin in ((q, expected[1]), (caches[0], caches[1])):
            torch.testing.assert_close(out.float(), twin.float(), rtol=2 ** -6, atol=2 * torch.finfo(dtype).eps)
    summed, _ = CudaKernels().attention_inputs(residual[:1], delta[:1], norm_weight, 1e-5, weight, None, heads,
                                               kv_heads, head_dim, table, positions[:1], slots[:1] // 4,
                                               slots[:1] % 4, caches[0][:, 1])
    assert torch.equal(residual[:1], kept) and summed.data_ptr() != residual.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_inputs_of_one_row_give_the_unfused_kernels_bits(dtype):
    """The fused kernel computes each input value as add_rms_norm's kernel does, sums in the row
    product's order and rotates as rope_store's kernel does, so where the norm kernel reduces with
    the same warps (rows up to 4096) it gives the unfused kernels' bits: a 16-bit model's greedy
    tokens do not change with the fusion."""
    from mcpd.kernels.cuda_kernels import CudaKernels
    from mcpd.kernels.torch_kernels import TorchKernels
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, hidden = 32, 4, 64, 2048
    residual, delta = (torch.randn(1, hidden, generator=generator).to(dtype).cuda() for _ in range(2))
    norm_weight = torch.randn(hidden, generator=generator).to(dtype).cuda()
    qkv = (torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=generator) * 0.02).to(dtype).cuda()
    table = RotaryEmbedding(head_dim, 10000.0, None, torch.device("cuda")).table(512, dtype)
    caches = [torch.zeros(12, 3, 2, 4, kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2)]
    arguments = (norm_weight, 1e-5, qkv, None, heads, kv_heads, head_dim, table, torch.tensor([300]).cuda(),
                 torch.tensor([3]).cuda(), torch.tensor([1]).cuda())
    kernels = CudaKernels()
    fused = kernels.attention_inputs(residual.clone(), delta, *arguments, caches[0][:, 2])
    unfused = TorchKernels.attention_inputs(kernels, residual.clone(), delta, *arguments, caches[1][:, 2])
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1]) and torch.equal(*caches)

"""The paged decode attention in Triton (models/cuda_kernels.py) against its torch twin, on a GPU
(CI has none: run where one is lent): every dtype, block size, group of query heads per KV head,
and context lengths around the kernel's tile of TOKENS, with tables padded by junk blocks."""
import pytest
import torch

from mcpd.models.kernels import TORCH
from mcpd.models.layers import AttentionGroup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [(16, 8, 2, 64), (1, 4, 4, 16), (8, 32, 4, 128),
                                                                   (32, 12, 12, 64), (16, 28, 4, 128)])
def test_paged_decode_attention_matches_the_torch_twin(dtype, block_size, heads, kv_heads, head_dim):
    from mcpd.models.cuda_kernels import TOKENS, decode_attention
    generator = torch.Generator().manual_seed(block_size * heads + head_dim)
    lengths = [1, TOKENS - 1, TOKENS, TOKENS + 1, 3 * TOKENS + 5, 7]
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

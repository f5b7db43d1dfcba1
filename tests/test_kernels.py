"""The native CPU kernels op by op against the torch kernels, and how they are built and refused.

float32 results agree to float32 rounding (only the order of sums differs); bfloat16 ones to one
bfloat16 step (a sum in another order may round the other way), except elementwise ops, which
round exactly as torch does."""
import os

import pytest
import torch

from mcpd.cpu import features
from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine
from mcpd.models import load_model
from mcpd.kernels import native
from mcpd.kernels.forms import tensors_of
from mcpd.quant.int8 import Int8Weight, quantize
from mcpd.kernels.native_kernels import NativeKernels
from mcpd.kernels.torch_kernels import TorchKernels
from mcpd.models.layers import AttentionMetadata, bind_kv_cache
from kernel_sets import NATIVE_SETS
from tiny_checkpoints import KINDS, make_checkpoint
from tiny_gguf import write_gguf

NATIVES, TORCH = {name: NativeKernels(name.removeprefix("native-")) for name in NATIVE_SETS}, TorchKernels()
CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def agree(mine: torch.Tensor, expected: torch.Tensor, steps: int = 1, rowwise: bool = False) -> bool:
    """Equal up to float32 rounding, or within `steps` bfloat16 steps of each value (rowwise:
    of the row's largest value, for weighted sums whose small results carry larger ones' error)."""
    assert mine.dtype == expected.dtype and mine.shape == expected.shape
    a, b = mine.float(), expected.float()
    if mine.dtype == torch.float32:
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    size = b.abs().amax(dim=-1, keepdim=True) if rowwise else b.abs()
    spacing = 2.0 ** (torch.floor(torch.log2(size.clamp(min=1e-30))) - 7)
    return bool(((a - b).abs() <= steps * spacing).all())


@pytest.fixture(params=NATIVE_SETS)
def native_kernels(request) -> NativeKernels:
    """Each native kernel set this CPU runs, in turn."""
    return NATIVES[request.param]


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernels_", [*NATIVES.values(), TORCH], ids=[*NATIVES, "torch"])
def test_prepare_lays_out_a_meta_weight_as_a_real_one(kernels_, dtype):
    """The device pool sizes and places the prepared weights from meta tensors, before reading any."""
    real, meta = kernels_.prepare(rand(33, 48, dtype=dtype)), kernels_.prepare(torch.empty(33, 48, dtype=dtype,
                                                                                              device="meta"))
    assert type(real) is type(meta)
    assert {f: (t.shape, t.dtype) for f, t in tensors_of(real).items()} == \
        {f: (t.shape, t.dtype) for f, t in tensors_of(meta).items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (1, 100, 64), (1, 400, 96), (3, 7, 16), (4, 40, 32), (5, 33, 48),
                                     (8, 33, 48), (9, 48, 80), (20, 12, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_on_packed_weights(native_kernels, dtype, m, n, k, bias):
    # 7, 33, 100: a panel, pair or run of four partly padding; 400 x 96: one row over both threads;
    # m: every row count of a tile (8 rows on AVX-512, 6 on AVX2) and several tiles
    x, w = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype)
    b = rand(n, dtype=dtype) if bias else None
    assert agree(native_kernels.linear(x, native_kernels.prepare(w), b), TORCH.linear(x, w, b))


@pytest.mark.parametrize("k", [400, 512])   # 512: native-amx's tiles take bfloat16 products, 400 they do not
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_gives_the_bits_it_gets_in_a_batch(native_kernels, dtype, k):
    """One row goes through its own kernel (four panels at once, a decode step's product), rows
    in a batch through the tile (16 at a time and a last few on AMX's): each output is the same
    sum in the same order, so a sequence's logits do not depend on what it is batched with."""
    x, w, b = rand(20, k, dtype=dtype), native_kernels.prepare(rand(1000, k, dtype=dtype)), rand(1000, dtype=dtype)
    batched, logits = native_kernels.linear(x, w, b), native_kernels.logits(x, w)
    for row in range(x.shape[0]):
        assert torch.equal(native_kernels.linear(x[row:row + 1], w, b), batched[row:row + 1])
        assert torch.equal(native_kernels.logits(x[row:row + 1], w), logits[row:row + 1])


@pytest.mark.skipif("native-amx" not in NATIVE_SETS, reason="this CPU has no AMX tiles")
def test_amx_products_after_torch_ran_tiles_of_its_own_on_the_same_threads():
    """torch's bfloat16 matmul (oneDNN) runs on AMX tiles too, on the threads the kernels share
    with torch, and leaves them shaped its way or released: each native call loads its own again."""
    kernels = NATIVES["native-amx"]
    x, w = rand(20, 512, dtype=torch.bfloat16), kernels.prepare(rand(1000, 512, dtype=torch.bfloat16))
    before = kernels.linear(x, w)
    a = rand(256, 1024, dtype=torch.bfloat16)
    torch.matmul(a, a.T)
    assert torch.equal(kernels.linear(x, w), before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_products_bits_do_not_depend_on_which_threads_took_its_strips(native_kernels, dtype):
    """Each thread owns a share of a product's strips and, done with it, takes the others' from
    the back (beside a busy neighbour one thread takes most): a strip is the same sums whichever
    thread computes it, so the bits do not change with who took what, nor with the thread count
    the thread tuner picks. Three rows of 100 outputs are below the threads' threshold: one
    thread takes its own share, then every other share from the back; nine rows run on the team."""
    x, w, b = rand(9, 64, dtype=dtype), native_kernels.prepare(rand(100, 64, dtype=dtype)), rand(100, dtype=dtype)
    team = native_kernels.linear(x, w, b)
    assert torch.equal(native_kernels.linear(x[:3], w, b), team[:3])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = native_kernels.linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, team)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_are_float32_holding_the_model_dtype(native_kernels, dtype):
    x, w = rand(2, 64, dtype=dtype), rand(300, 64, dtype=dtype)
    logits = native_kernels.logits(x, native_kernels.prepare(w))
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.to(dtype).float())
    assert agree(logits.to(dtype), TORCH.logits(x, w).to(dtype))


@pytest.mark.parametrize("n", [1, 15, 16, 300, 32000])
def test_argmax_is_numpys_on_ties_nan_and_infinities(native_kernels, n):
    """The greedy token: the first of equal maxima, the first NaN of a row that has one; rows of
    every length, the maximum in the vector part, the tail, or both."""
    rows = rand(9, n)
    rows[1] = float("-inf")
    rows[2, -1] = rows[2].max() + 1                                      # in the tail (or the only value)
    rows[3] = 0.0                                                        # all tied: the first
    rows[4, n // 2] = rows[4, -1] = rows[4].max() + 1                    # tied maxima, the first wins
    rows[5, n // 3] = float("nan")
    rows[6, -1], rows[6, 0] = float("nan"), float("inf")                 # a NaN beats +inf
    rows[7, 0] = float("inf")
    rows[8] = float("nan")
    expected = torch.from_numpy(rows.numpy().argmax(axis=-1))
    assert torch.equal(native_kernels.argmax(rows), expected)
    assert torch.equal(TORCH.argmax(rows), expected)
    assert torch.equal(native_kernels.argmax(rows[::2]), expected[::2])           # rows not contiguous
    assert torch.equal(native_kernels.argmax(rows.double()), expected)             # not float32: torch's way


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows_of_a_packed_matrix(native_kernels, dtype):
    table, ids = rand(40, 32, dtype=dtype), torch.tensor([0, 39, 17, 16, 15, 17])
    assert torch.equal(native_kernels.embedding(ids, native_kernels.prepare(table), dtype),
                       TORCH.embedding(ids, table, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_rows_of_a_plain_table(native_kernels, dtype):
    """An embedding not tied to the LM head stays a plain table: its rows, copied natively."""
    table, ids = rand(40, 32, dtype=dtype), torch.tensor([0, 39, 17, 16, 15, 17])
    assert torch.equal(native_kernels.embedding(ids, table, dtype), TORCH.embedding(ids, table, dtype))
    for bad in ([40], [0, -1]):   # refused before anything is read, as F.embedding refuses
        with pytest.raises(IndexError):
            native_kernels.embedding(torch.tensor(bad), table, table.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(native_kernels, dtype, with_delta):
    residual, weight = rand(5, 64, dtype=dtype, scale=3), rand(64, dtype=dtype)
    delta = rand(5, 64, dtype=dtype) if with_delta else None
    expected_residual, expected = TORCH.add_rms_norm(residual.clone(), delta, weight, 1e-5)
    mine_residual, mine = native_kernels.add_rms_norm(residual.clone(), delta, weight, 1e-5)
    assert torch.equal(mine_residual, expected_residual)   # an elementwise add rounds as torch does
    assert agree(mine, expected)


def _cache(blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype) -> torch.Tensor:
    """A layer's view of a [blocks, layers=2, 2, block_size, kv_heads, head_dim] cache."""
    return rand(blocks, 2, 2, block_size, kv_heads, head_dim, dtype=dtype)[:, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_store(native_kernels, dtype, head_dim):
    heads, kv_heads, tokens, block_size = 4, 2, 20, 4
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.arange(30, 30 + tokens)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    slot_blocks, slot_offsets = order[positions // block_size - 7], positions % block_size
    table = torch.stack((torch.rand(64, head_dim), torch.rand(64, head_dim)), dim=1).to(dtype).float()
    results = []
    for impl in (native_kernels, TORCH):
        cache, rows = _cache(8, block_size, kv_heads, head_dim, dtype), qkv.clone()
        q = impl.rope_store(rows, heads, kv_heads, head_dim, table, positions, slot_blocks, slot_offsets, cache)
        results.append((q.reshape(tokens, -1).clone(), cache))
    (q, cache), (q_expected, cache_expected) = results
    if dtype == torch.bfloat16:   # each product and sum rounds to bfloat16 as in torch: exact
        assert torch.equal(q, q_expected) and torch.equal(cache, cache_expected)
    else:                         # the compiler may fuse a product and a sum (one rounding less)
        assert agree(q, q_expected) and agree(cache, cache_expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(native_kernels, dtype):
    gate_up = rand(3, 2 * 48, dtype=dtype, scale=4)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])   # exp under- and overflow, zeros
    assert agree(native_kernels.silu_mul(gate_up), TORCH.silu_mul(gate_up))


def _scattered_tables(lens: list[int], block_size: int, blocks: int) -> list[list[int]]:
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables, used = [], 0
    for length in lens:
        need = -(-length // block_size)
        tables.append(order[used:used + need])
        used += need
    return tables


@pytest.mark.parametrize("dtype", DTYPES)
# (8, 2, 64), (9, 3, 64), (8, 1, 64), (8, 2, 128), (2, 2, 128): the shapes the kernel compiles with constant sizes.
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (8, 1, 64), (2, 2, 32), (8, 2, 64), (9, 3, 64),
                                                       (8, 2, 128), (2, 2, 128)])
def test_decode_attention_reads_the_paged_cache_in_place(native_kernels, dtype, heads, kv_heads, head_dim):
    block_size, lens = 4, [1, 17, 100, 64]   # 100 and 64 cross the kernel's 64-key chunks
    cache = _cache(100, block_size, kv_heads, head_dim, dtype)
    tables = _scattered_tables(lens, block_size, 100)
    attn = AttentionMetadata.build(tables, [n - 1 for n in lens], [1] * len(lens), block_size, CPU)
    q = rand(len(lens), heads, head_dim, dtype=dtype)
    args = (cache, attn.groups[0], head_dim ** -0.5)
    assert agree(native_kernels.decode_attention(q, *args), TORCH.decode_attention(q, *args), rowwise=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (8, 1, 64), (32, 2, 32)])
def test_prefill_attention_is_causal_over_the_paged_cache(native_kernels, dtype, heads, kv_heads, head_dim):
    """Chunks of several sequences: one from position 0, one after a cached history, one of 70
    queries (past a 64-row work unit), one of 2; keys and queries cross 16-key chunks unaligned."""
    block_size, starts, counts = 4, [0, 37, 3, 90], [21, 9, 70, 2]
    lens = [s + n for s, n in zip(starts, counts)]
    cache = _cache(80, block_size, kv_heads, head_dim, dtype)
    attn = AttentionMetadata.build(_scattered_tables(lens, block_size, 80), starts, counts, block_size, CPU)
    q = rand(sum(counts), heads, head_dim, dtype=dtype)
    args = (cache, attn.groups[0], head_dim ** -0.5)
    assert agree(native_kernels.prefill_attention(q, *args), TORCH.prefill_attention(q, *args), rowwise=True)


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "gpt2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("native_set", NATIVE_SETS)
def test_the_native_decoder_stack_equals_the_torch_kernels_layer_by_layer(kind, dtype, native_set, tmp_path):
    """One step of decodes, a prefill chunk after a cached history, and a decode after it (three
    attention groups) through the whole model: mcpd_decoder_stack against the torch kernels."""
    path = make_checkpoint(tmp_path, kind)
    starts, counts, block_size = [5, 8, 0, 11], [1, 1, 9, 1], 4
    tables = _scattered_tables([s + n for s, n in zip(starts, counts)], block_size, 24)
    attn = AttentionMetadata.build(tables, starts, counts, block_size, CPU)
    ids = rand(sum(counts), scale=100).abs().long() % 300
    hidden = {}
    for name in (native_set, "torch"):
        model = load_model(ModelConfig(path=str(path), dtype=str(dtype).removeprefix("torch.")), CPU).model
        model.use_kernels(name)
        cache = _cache(24, block_size, model.num_kv_heads, model.head_dim, dtype)
        bind_kv_cache(model, cache[:, None].expand(-1, model.num_layers, -1, -1, -1, -1).contiguous())
        with torch.inference_mode():
            hidden[name] = model(ids, attn.positions, attn)
    assert len(attn.groups) == 3
    # bfloat16: each product's sum in another order may round one step the other way, and the
    # layers carry those steps on (3 of the row's largest value seen here).
    assert agree(hidden[native_set], hidden["torch"], steps=4, rowwise=True)


def _on_a_cache(path, dtype, native_set: str, block_size: int):
    """The model at path on native_set, and the cache of 24 blocks bound to every layer."""
    model = load_model(ModelConfig(path=str(path), dtype=str(dtype).removeprefix("torch.")), CPU).model
    model.use_kernels(native_set)
    cache = _cache(24, block_size, model.num_kv_heads, model.head_dim, dtype)
    every_layers = cache[:, None].expand(-1, model.num_layers, -1, -1, -1, -1).contiguous()
    bind_kv_cache(model, every_layers)
    return model, every_layers


@pytest.mark.parametrize("rows", [[0, 10, 17], [10], []])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("native_set", NATIVE_SETS)
def test_the_native_stack_gives_the_rows_asked_for_the_bits_of_the_whole_steps(rows, dtype, native_set, tmp_path):
    """A step of a decode, a prompt's one-token chunk, a prompt's last chunk, a prompt's middle
    chunk and a decode: the rows that sample (each the last of its sequence) come out of the stack
    with the bits they have among every row's, and every row's keys and values are stored alike.
    [10]: both decode groups have none of the rows; []: no row samples (a step of middle chunks)."""
    path = make_checkpoint(tmp_path, "llama")
    starts, counts, block_size = [5, 8, 0, 3, 11], [1, 1, 9, 6, 1], 4
    tables = _scattered_tables([s + n for s, n in zip(starts, counts)], block_size, 24)
    attn = AttentionMetadata.build(tables, starts, counts, block_size, CPU)
    ids = rand(sum(counts), scale=100).abs().long() % 300
    model, every_layers = _on_a_cache(path, dtype, native_set, block_size)
    history = every_layers.clone()
    with torch.inference_mode():
        every = model(ids, attn.positions, attn)
        stored = every_layers.clone()
        every_layers.copy_(history)
        asked = model(ids, attn.positions, attn, torch.tensor(rows, dtype=torch.long))
    assert len(attn.groups) == 3
    assert torch.equal(asked, every[rows])
    assert torch.equal(every_layers, stored)


@pytest.mark.parametrize("qtype, kind", [("Q4_1", "llama"), ("Q8_0", "qwen2"), ("Q4_K_M", "llama_wide"),
                                         ("Q4_0_Q8_0", "qwen2"), ("float", "llama"), ("float", "qwen2")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("native_set", NATIVE_SETS)
def test_a_lone_decode_through_the_stack_has_the_bits_it_has_beside_another(qtype, kind, dtype, native_set, tmp_path):
    """A decode step of one sequence (the stack's one-row region: its own norms, shares of each
    product and KV heads per thread), over quantized layers or plain ones, alone and with rows
    asked for, gives the hidden state and stores the keys and values that a step of two decodes
    gives it."""
    path = make_checkpoint(tmp_path, kind) if qtype == "float" else write_gguf(tmp_path, kind, qtype)
    starts, block_size = [5, 8], 4
    tables = _scattered_tables([n + 1 for n in starts], block_size, 24)
    ids = torch.tensor([17, 250])
    model, every_layers = _on_a_cache(path, dtype, native_set, block_size)
    history = every_layers.clone()
    with torch.inference_mode():
        both_attn = AttentionMetadata.build(tables, starts, [1, 1], block_size, CPU)
        both = model(ids, both_attn.positions, both_attn)
        stored = every_layers.clone()
        for rows in (None, torch.tensor([0])):
            every_layers.copy_(history)
            for i in range(2):
                attn = AttentionMetadata.build(tables[i:i + 1], starts[i:i + 1], [1], block_size, CPU)
                alone = model(ids[i:i + 1], attn.positions, attn, rows)
                assert torch.equal(alone, both[i:i + 1])
            assert torch.equal(every_layers, stored)


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The kernels' cache under tmp_path (and not systemd's, if the tests run under a unit)."""
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_systemds_cache_directory_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path / 'unit'}:{tmp_path / 'other'}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native._cache_dir() == tmp_path / "unit" / "kernels"


def test_a_cache_directory_open_to_others_is_refused(cache_home):
    tmp_path = cache_home
    (tmp_path / "mcpd" / "kernels").mkdir(parents=True)
    os.chmod(tmp_path / "mcpd" / "kernels", 0o777)
    with pytest.raises(native.NativeUnavailable, match="not a private directory"):
        native._cache_dir()


def test_a_library_others_may_write_is_not_loaded(tmp_path):
    library = tmp_path / "kernels.so"
    library.write_bytes(b"\x7fELF")
    os.chmod(library, 0o766)
    with pytest.raises(native.NativeUnavailable, match="not a private file"):
        native._check_private(library, is_dir=False)


def test_without_a_compiler_auto_falls_back_to_torch_and_native_refuses(cache_home, monkeypatch):
    tmp_path = cache_home
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert Engine(Config(engine=EngineConfig(pool_bytes=4 << 20)), torch.device("cpu")).stats()["kernels"] == "torch"
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        Engine(Config(engine=EngineConfig(pool_bytes=4 << 20, kernels="native")), torch.device("cpu"))


@pytest.mark.parametrize("flags, chosen", [({"avx512f", "avx2", "fma"}, "native-avx512"),
                                           ({"avx2", "fma"}, "native-avx2"), ({"avx2"}, "torch"), (set(), "torch")])
def test_auto_and_native_take_the_best_kernel_set_the_cpu_runs(flags, chosen, monkeypatch):
    """AVX-512 where the CPU has it, else AVX2 + FMA, else torch's kernels (native refuses); a
    set asked for by name the CPU lacks is refused. The flags are those of a CPU this one can
    stand in for (a subset of its own)."""
    if not all(features.has(flag) for flag in flags):
        pytest.skip(f"this CPU lacks some of {sorted(flags)}")
    monkeypatch.setattr(features, "has", lambda flag: flag in flags)

    def engine(kernels: str) -> Engine:
        return Engine(Config(engine=EngineConfig(pool_bytes=4 << 20, kernels=kernels)), torch.device("cpu"))

    assert engine("auto").stats()["kernels"] == chosen
    if chosen == "torch":
        with pytest.raises(native.NativeUnavailable, match="this CPU has neither"):
            engine("native")
    else:
        assert engine("native").stats()["kernels"] == chosen
    for isa in native.ISAS:
        if native.runs_here(isa):
            assert engine(f"native-{isa}").stats()["kernels"] == f"native-{isa}"
        else:
            with pytest.raises(native.NativeUnavailable, match="this CPU lacks them"):
                engine(f"native-{isa}")


def test_the_library_is_built_once_and_cached(cache_home, monkeypatch):
    tmp_path = cache_home
    monkeypatch.setattr(native, "_loaded", {})
    native.load(native.best_isa())
    built = list((tmp_path / "mcpd" / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so" and built[0].stat().st_mode & 0o077 == 0
    first = built[0].stat()
    monkeypatch.setattr(native, "_loaded", {})
    native.load(native.best_isa())
    again = list((tmp_path / "mcpd" / "kernels").iterdir())
    assert again == built and (again[0].stat().st_ino, again[0].stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (1, 33, 52), (3, 7, 16), (8, 48, 80), (11, 40, 32),
                                     (1, 48, 200), (5, 48, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_native_against_the_torch_twin(native_kernels, dtype, m, n, k, bias):
    """Both multiply x by the same dequantized weights (values * group scale, in float32): they
    differ in the order of sums only (one row sums in four runs), so agree() as for float weights
    holds. n = 33, 7, 40: a panel or pair partly padding; k = 52: the one-row kernel's tail;
    k = 80, 200: several groups of int8.GROUP columns (32 or 64), the last one short."""
    x, w = rand(m, k, dtype=dtype), rand(n, k, scale=0.05)
    weight = Int8Weight(*quantize(w))
    b = rand(n, dtype=dtype) if bias else None
    assert agree(native_kernels.linear(x, native_kernels.prepare(weight), b), TORCH.linear(x, weight, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_logits_native_against_the_torch_twin(native_kernels, dtype):
    x, weight = rand(2, 64, dtype=dtype), Int8Weight(*quantize(rand(300, 64)))
    logits = native_kernels.logits(x, native_kernels.prepare(weight))
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.to(dtype).float())
    assert agree(logits.to(dtype), TORCH.logits(x, weight).to(dtype))


@pytest.mark.parametrize("group", [64, 32])
def test_a_row_of_an_int8_product_gets_the_bits_it_gets_alone_at_any_row_count(native_kernels, group):
    """Whatever rows share a product (a step of one-token prompts, a tile's rows, the rows past a
    tile: 2 to 17 spans AVX-512's 8-row tile and AVX2's 6-row one twice), each row's outputs are
    those of a decode step of it alone: a row's int8 sums are integers, in any order the same. k =
    200: groups of 64 (mcpd's) or 32 (a GGUF Q8_0's), the last one short. float32, where a sum in
    another order shows; bfloat16 rows take the same code (the agreement tests above cover it)."""
    most, k = 17, 200
    x = rand(most, k)
    values = torch.randint(-127, 128, (400, k), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    weight = native_kernels.prepare(Int8Weight(values, rand(400, -(-k // group), scale=0.01).abs()))
    b = rand(400)
    alone = [(native_kernels.linear(x[r:r + 1], weight, b), native_kernels.logits(x[r:r + 1], weight))
             for r in range(most)]
    for rows in range(2, most + 1):
        batched, logits = native_kernels.linear(x[:rows], weight, b), native_kernels.logits(x[:rows], weight)
        for row in range(rows):
            assert torch.equal(batched[row:row + 1], alone[row][0]) and torch.equal(logits[row:row + 1], alone[row][1])


@pytest.mark.parametrize("kernels_", [*NATIVES.values(), TORCH], ids=[*NATIVES, "torch"])
def test_int8_products_round_each_activation_row_to_int16(kernels_):
    """Each row of x is rounded to int16 levels of its own largest value (32767 levels) before
    the int8 product, in the native kernels and the torch twin alike. Row 0's largest is 32767,
    so its step is exactly 1 and 0.25 rounds to 0: the product is 32767 * column 0, exactly (a
    float product would add 0.25 * column 1). Row 1 is row 0 over 2^17: its own step, so the
    same levels, not zeros. Row 2 holds a NaN: all its outputs are NaN, as a float product's."""
    k = 64
    values = torch.randint(-127, 128, (48, k), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    weight = Int8Weight(values, torch.ones(48, 1))
    x = torch.zeros(3, k)
    x[0, 0], x[0, 1] = 32767.0, 0.25
    x[1] = x[0] / 2.0 ** 17
    x[2, 5] = float("nan")
    y = kernels_.linear(x, kernels_.prepare(weight))
    expected = 32767.0 * values[:, 0].float()
    assert torch.equal(y[0], expected) and torch.equal(y[1], expected / 2.0 ** 17)
    assert bool(y[2].isnan().all())


def test_an_int8_matrix_of_an_odd_number_of_columns_is_refused_by_the_native_kernels():
    """The native int8 panels hold each output's inputs in pairs."""
    values = torch.ones(16, 31, dtype=torch.int8)
    for kernels_ in NATIVES.values():
        with pytest.raises(ValueError, match="31 columns: the native kernels take pairs"):
            kernels_.prepare(Int8Weight(values, torch.ones(16, 1)))

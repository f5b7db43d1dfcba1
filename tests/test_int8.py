"""model.quantization = "int8": quantizing, loading (from float and from int8 checkpoints), and
the engine generating with it on both kernels. The native kernel against the torch twin op by op
is in test_kernels.py; the CUDA kernel (int8_cuda.py) against it is here, run where a GPU is lent
(CI has none)."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from mcpd.config import Config, EngineConfig, ModelConfig
from mcpd.engine import Engine, SamplingParams
from mcpd.engine.kv_records import region_key
from mcpd.models import UnsupportedModel, load_model
from mcpd.quant import int8
from mcpd.quant.agreement import compare, position_logits
from mcpd.quant.int8 import GROUP, LEVELS, RATIOS, Int8Weight, dequantize, groups, quantize
from kernel_sets import NATIVE_SETS
from tiny_checkpoints import make_checkpoint

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")
PROMPTS = [[0, 17, 42, 99, 5], [0, 250, 3, 3, 3, 71, 12, 8], [0, 64]]
# The tiny checkpoints' random weights give near-ties at a few positions in every hundred, and
# there the last bits decide: 0.94-0.96 measured on these prompts (a trained model's
# distributions are far more peaked). The bound catches a broken quantizer (a wrong scale or
# row gives agreement near 1/vocab) without pretending to the 0.98.
MIN_TOP1, MAX_MEAN_KL = 0.9, 0.01


def test_round_trip_is_within_half_a_step_of_each_group():
    columns = 2 * GROUP + 17   # the last group short
    w = torch.randn(37, columns, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    w[9, GROUP:2 * GROUP] = 0.0
    values, scales = quantize(w)
    assert values.dtype == torch.int8 and values.shape == w.shape
    assert scales.dtype == torch.float32 and scales.shape == (37, groups(columns)) == (37, 3)
    assert int(values.abs().max()) <= LEVELS and int(values.min()) >= -LEVELS
    peaks = torch.stack([v.abs().amax(dim=1) for v in values.split(GROUP, dim=1)], dim=1)
    nonzero = peaks > 0
    assert int(nonzero.sum()) == 37 * 3 - 3 - 1   # every group but the zero ones reaches near the last step
    assert bool((peaks[nonzero] >= round(LEVELS / max(RATIOS))).all())
    step = scales.repeat_interleave(GROUP, dim=1)[:, :columns]
    assert bool(((dequantize(values, scales) - w).abs() <= step / 2 * (1 + 1e-6)).all())   # to the nearest step
    assert bool((scales[5] == 1).all()) and not values[5].any()   # an all-zero row stays zero
    assert scales[9, 1] == 1 and not values[9, GROUP:2 * GROUP].any()   # and an all-zero group


def test_each_group_errs_no_more_than_with_its_peak_as_the_last_step():
    """The searched scale (RATIOS) against max|w| / LEVELS, the scheme before it: per group, the
    squared rounding error is never larger, and over a Normal matrix clearly smaller."""
    w = torch.randn(64, 4 * GROUP, generator=torch.Generator().manual_seed(3))
    values, scales = quantize(w)
    peak_scales = torch.stack([g.abs().amax(dim=1) for g in w.split(GROUP, dim=1)], dim=1) / LEVELS
    peak_values = torch.round(w / peak_scales.repeat_interleave(GROUP, dim=1))

    def group_errors(approx):
        return torch.stack([g.square().sum(dim=1) for g in (approx - w).split(GROUP, dim=1)], dim=1)

    searched, peak = group_errors(dequantize(values, scales)), group_errors(dequantize(peak_values, peak_scales))
    assert bool((searched <= peak * (1 + 1e-6)).all())
    assert float(searched.sum()) < 0.95 * float(peak.sum())


def test_fused_rows_quantize_as_their_pieces():
    """Groups lie within a row: q, k and v quantized apart (as a checkpoint holds them) equal the
    fused qkv matrix quantized at once, so both loading routes give the same model."""
    w = torch.randn(48, 2 * GROUP, generator=torch.Generator().manual_seed(2))
    whole = quantize(w)
    parts = [quantize(p) for p in w.split((16, 16, 16))]
    assert torch.equal(whole[0], torch.cat([p[0] for p in parts]))
    assert torch.equal(whole[1], torch.cat([p[1] for p in parts]))


def test_kv_records_of_an_int8_model_are_not_a_float_ones():
    """The KV an int8 model computes differs from the float model's: stored KV (host cache,
    contexts) is keyed apart."""
    assert region_key(ModelConfig(), "m", ()) != region_key(ModelConfig(quantization="int8"), "m", ())


def engine(path, quantization: str, kernels: str, device: torch.device = CPU) -> Engine:
    config = Config(model=ModelConfig(path=str(path), quantization=quantization),
                    engine=EngineConfig(pool_bytes=32 << 20, kernels=kernels))
    return Engine(config, device)


def generate(bench: Engine, new_tokens: int = 24) -> list[list[int]]:
    """Each prompt and its greedy continuation, all prompts batched together."""
    tokens = {i: list(p) for i, p in enumerate(PROMPTS)}
    for i, prompt in enumerate(PROMPTS):
        bench.add_request(i, prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    while bench.has_work:
        for out in bench.step():
            tokens[out.key] += out.token_ids
    return [tokens[i] for i in range(len(PROMPTS))]


def loaded(path, quantization: str, kernels: str = "auto", device: torch.device = CPU):
    model = load_model(ModelConfig(path=str(path), quantization=quantization), device).model
    model.use_kernels(kernels)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])   # qwen2: a tied head (stays float)
@pytest.mark.parametrize("native_set", NATIVE_SETS)
def test_engine_generates_with_int8_close_to_the_float_model(tmp_path, kind, native_set):
    path = make_checkpoint(tmp_path / kind, kind)
    native, portable = generate(engine(path, "int8", native_set)), generate(engine(path, "int8", "torch"))
    # The two kernels sum in other orders; on these checkpoints no greedy choice is that close.
    assert native == portable
    float_sequences = generate(engine(path, "none", "auto"))
    agreement = compare(loaded(path, "none"), loaded(path, "int8"), float_sequences)
    assert agreement.top1 >= MIN_TOP1 and agreement.mean_kl <= MAX_MEAN_KL, agreement


def test_int8_model_holds_a_quarter_of_the_float_weight_bytes(tmp_path):
    path = make_checkpoint(tmp_path / "llama", "llama")
    model = load_model(ModelConfig(path=str(path), quantization="int8"), CPU).model
    assert "slower than float" in model.use_kernels("torch")   # the worker logs why
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32 for m in linears)
    assert model.model.embed_tokens.weight.dtype == torch.float32


def write_int8_checkpoint(source, target, quantizer=quantize):
    """source's directory with every linear weight as int8 + weight_scale (docs/MODELS.md);
    quantizer(float matrix) -> (values, scales)."""
    target.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            tensors[name], tensors[name + "_scale"] = quantizer(tensor)
        else:
            tensors[name] = tensor
    save_file(tensors, target / "model.safetensors")
    return tensors


def test_an_int8_checkpoint_loads_as_the_float_one_quantized_at_load(tmp_path):
    source = make_checkpoint(tmp_path / "float", "llama")
    target = tmp_path / "int8"
    write_int8_checkpoint(source, target)
    from_int8, from_float = loaded(target, "int8", "torch"), loaded(source, "int8", "torch")
    for (name, a), (_, b) in zip(from_int8.named_parameters(), from_float.named_parameters()):
        assert torch.equal(a, b), name
    assert generate(engine(target, "int8", "auto")) == generate(engine(source, "int8", "auto"))


def quantize_per_row(weight):
    """One scale a row, [out]: a checkpoint of another tool, or of mcpd before groups."""
    scales = weight.abs().amax(dim=1) / LEVELS
    return torch.round(weight / scales[:, None]).to(torch.int8), scales


@pytest.mark.parametrize("native_set", NATIVE_SETS)
def test_a_per_row_int8_checkpoint_loads_with_its_scale_in_every_group(tmp_path, native_set):
    target = tmp_path / "int8"
    tensors = write_int8_checkpoint(make_checkpoint(tmp_path / "float", "llama"), target, quantize_per_row)
    model = loaded(target, "int8", "torch")
    down = model.model.layers[1].mlp.down_proj
    assert down.weight_scale.shape == (down.weight.shape[0], groups(down.weight.shape[1]))
    name = "model.layers.1.mlp.down_proj.weight"
    per_row = tensors[name].float() * tensors[name + "_scale"][:, None]
    assert torch.equal(dequantize(down.weight, down.weight_scale), per_row)
    assert generate(engine(target, "int8", native_set)) == generate(engine(target, "int8", "torch"))


def test_an_int8_checkpoint_is_refused_without_quantization(tmp_path):
    target = tmp_path / "int8"
    write_int8_checkpoint(make_checkpoint(tmp_path / "float", "llama"), target)
    with pytest.raises(UnsupportedModel, match='torch.int8.*set model.quantization = "int8"'):
        load_model(ModelConfig(path=str(target)), CPU)


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight_scale",
                             -t["model.layers.0.self_attn.q_proj.weight_scale"]), "not finite and positive"),
    (lambda t: t["model.layers.1.mlp.down_proj.weight_scale"].__setitem__(3, float("nan")), "not finite and positive"),
    (lambda t: t.__setitem__("lm_head.weight_scale", t["lm_head.weight_scale"].double()), "not float32"),
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"), "lacks weights for model.layers.0.mlp.gate_up_proj"),
    (lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"].to(torch.int16)), "torch.int16"),
    (lambda t: t.__setitem__("lm_head.weight_scale", t["lm_head.weight_scale"][:, :-1]), "does not fit"),
    (lambda t: t.__setitem__("lm_head.weight_scale", t["lm_head.weight_scale"][..., None]), "does not fit"),
    (lambda t: t.__setitem__("lm_head.weight_scale", t["lm_head.weight_scale"][0, 0]), "does not fit"),
])
def test_damaged_int8_checkpoints_are_refused(tmp_path, damage, message):
    target = tmp_path / "int8"
    tensors = write_int8_checkpoint(make_checkpoint(tmp_path / "float", "llama"), target)
    damage(tensors)
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(UnsupportedModel, match=message):
        load_model(ModelConfig(path=str(target), quantization="int8"), CPU)


def test_int8_is_refused_for_gpt2(tmp_path):
    path = make_checkpoint(tmp_path / "gpt2", "gpt2")
    with pytest.raises(UnsupportedModel, match="Llama family only"):
        load_model(ModelConfig(path=str(path), quantization="int8"), CPU)


def test_embedded_model_runs_int8_with_the_float_weights_quantized():
    """Its weights quantized from the float ones; the engine's tokens are the int8 model's own
    greedy choices. (Its wide random weights, std 0.2, make it a poor judge of quality: 0.87
    top-1 agreement, KL 0.04, measured; the checkpoints above are the figures.)"""
    int8_model = loaded("", "int8")
    float_qkv = load_model(ModelConfig(), CPU).model.model.layers[2].self_attn.qkv_proj.weight
    form = int8_model.forms["model.layers.2.self_attn.qkv_proj.weight"]   # the scales are its form's only
    scales = form.scales if isinstance(form, Int8Weight) else \
        form.scales.transpose(1, 2).flatten(0, 1)[:form.n]   # Packed: [n/16, groups, 16] panels
    assert torch.equal(scales, quantize(float_qkv)[1])
    for prompt, tokens in zip(PROMPTS, generate(Engine(Config(model=ModelConfig(quantization="int8")), CPU))):
        choices = position_logits(int8_model, tokens).argmax(-1).tolist()
        assert choices[len(prompt) - 1:-1] == tokens[len(prompt):]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 100, 300])   # each of int8_cuda's paths and its edges
def test_the_cuda_kernels_multiply_as_the_twin(dtype, rows):
    """int8_cuda.linear against int8.linear on the same card: a short last group, outputs not a
    multiple of any tile, with a bias. The tile kernel rounds the dequantized weight to dtype
    (float32 to TF32) before the tensor cores: each product errs by at most 2^-8 of |x| |w|;
    then both round the float32 sum to dtype, one step of it apart at most."""
    from mcpd.quant import int8_cuda
    generator = torch.Generator().manual_seed(rows)
    n, k = 203, 3 * GROUP + 17
    values, scales = quantize(torch.randn(n, k, generator=generator) * 0.02)
    weight = Int8Weight(values.cuda(), scales.cuda())
    x = torch.randn(rows, k, generator=generator).to("cuda", dtype)
    bias = torch.randn(n, generator=generator).to("cuda", dtype)
    y, twin = int8_cuda.linear(x, weight, bias), int8.linear(x, weight, bias)
    assert y.dtype == dtype and y.shape == (rows, n)
    bound = 2 ** -8 * (x.float().abs() @ dequantize(weight.values, weight.scales).abs().T)
    bound += torch.finfo(dtype).eps * twin.float().abs() + 1e-6
    assert bool(((y.float() - twin.float()).abs() <= bound).all())


@needs_cuda
def test_the_cuda_kernel_takes_leading_dimensions_and_no_bias():
    from mcpd.quant import int8_cuda
    values, scales = quantize(torch.randn(64, 2 * GROUP, generator=torch.Generator().manual_seed(4)))
    weight = Int8Weight(values.cuda(), scales.cuda())
    x = torch.randn(2, 3, 2 * GROUP, device="cuda")
    y = int8_cuda.linear(x, weight)
    assert y.shape == (2, 3, 64)
    assert torch.allclose(y, int8.linear(x, weight), rtol=1e-2, atol=1e-2)
    assert int8_cuda.linear(x[:, :0], weight).shape == (2, 0, 64)


@needs_cuda
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_an_int8_model_on_a_gpu_agrees_with_the_float_model_as_on_the_cpu(tmp_path, kind):
    """The same quantized weights on the card's kernel: agreement with the float model within
    the tests' bounds, and close to the CPU's (TF32 moves near-ties only)."""
    path = make_checkpoint(tmp_path / kind, kind)
    cuda = torch.device("cuda")
    int8_engine = engine(path, "int8", "torch", cuda)
    assert int8_engine.stats()["device"].startswith("cuda")
    assert all(len(tokens) == len(prompt) + 24 for prompt, tokens in zip(PROMPTS, generate(int8_engine)))
    sequences = generate(engine(path, "none", "auto"))
    on_gpu = compare(loaded(path, "none", "torch", cuda), loaded(path, "int8", "torch", cuda), sequences)
    on_cpu = compare(loaded(path, "none"), loaded(path, "int8"), sequences)
    assert on_gpu.top1 >= MIN_TOP1 and on_gpu.mean_kl <= MAX_MEAN_KL, on_gpu
    assert abs(on_gpu.mean_kl - on_cpu.mean_kl) <= 0.1 * on_cpu.mean_kl, (on_gpu, on_cpu)

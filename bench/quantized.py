"""int8 weight-only quantization (model.quantization = "int8") against the float32 model, side by side.

    .venv/bin/python bench/quantized.py [--quick] [--device cuda] [--kernels auto|native-avx2|...]

The model: the 55.3M bench Llama of bench/peerkit/checkpoints.py (8 layers, hidden 512, 8/2
heads, intermediate 1408, vocab 32000, random Normal(0, 0.02) weights), float32 on disk; the int8
variant is quantized from it at load, as a daemon with model.quantization = "int8" would.

- W1 decode: one request, a 128-token prompt of random ids, greedy, EOS ignored; tok/s over the
  tokens after the first. Two engines in one process, float32 and int8, in alternating rounds;
  `int8_decode_speedup` is the median of the rounds' int8/float32 ratios (paired: this machine
  is shared, and its speed drifts between rounds more than within one). Beside it, the ratio of
  the two variants' fast-decile step times (`fast_decile`), what the kernels do when the
  process has the cores, and the load average during the run.
- Quality, on two checkpoints of that architecture: over prompts and the float32 engine's greedy
  continuations of them, every position's next-token distribution of the int8 model against the
  float32 one (teacher-forced, mcpd/quant/agreement.py): top-1 agreement, mean KL(float ||
  int8) in nats, and the float model's mean top-1 probability (how peaked its distributions are).
  - the random checkpoint above (`int8_top1_agreement`, `int8_mean_kl`: the figures the tests'
    checkpoints resemble), on the decode rounds' prompts. Random weights give flat distributions
    (the float model's most likely token has ~2e-4 probability, its lead over the second ~2e-5),
    so near-ties any rounding flips decide many positions: a floor for a trained model's.
  - a briefly trained copy of it (`*_trained`; bench/peerkit/trained.py: a few hundred AdamW
    steps on the repo's docs/*.md, cached; the first run trains it, minutes), on prompts cut
    from the repo's README.md, which it was not trained on.

On a GPU (`--device cuda`) the float model is bfloat16, as one serves it there, and the int8
variant multiplies with the Triton kernel (mcpd/quant/int8_cuda.py); the trained checkpoint is
not built there (no cache travels). At 55.3M parameters a GPU step is bound by kernel launches,
not by the weights' bytes, so the W1 ratio says what the kernel costs in launches; the bytes'
speedup shows on the matrices of a 7B Llama layer (4096 hidden, 11008 intermediate), each product
timed alone (`product_*`: bf16 torch against int8, the time of one product and the GB/s its
weights stream at, for 1, 8, 64 and 512 rows).

The last line is one JSON object. measure(quick) returns its figures for other benches.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from mcpd.cpu import threads

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 48 tokens (under a minute)")
    parser.add_argument("--threads", type=int, default=0, help="engine threads; 0: as a worker picks them")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--kernels", default="auto", help="engine.kernels of both variants (native-avx2: the AVX2 "
                                                          "kernels on an AVX-512 machine)")
    return parser.parse_args()


if __name__ == "__main__":   # before torch: OpenMP reads its environment once, at load
    ARGS = parse_args()
    threads.configure(workers=1, index=0, requested=ARGS.threads, wait_policy="passive")

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peerkit import checkpoints, trained  # noqa: E402

from mcpd.config import Config, EngineConfig, ModelConfig  # noqa: E402
from mcpd.engine import Engine, SamplingParams  # noqa: E402
from mcpd.models import load_model  # noqa: E402
from mcpd.quant.agreement import compare  # noqa: E402

PROMPT_TOKENS = 128
HELD_OUT = Path(__file__).resolve().parent.parent / "README.md"   # the trained model's prompts
VARIANTS = ("none", "int8")   # model.quantization: the float32 baseline, then int8


def float_dtype(device: torch.device) -> str:
    """The float model's dtype: float32 on the CPU (its fast kernels), bfloat16 on a GPU."""
    return "float32" if device.type == "cpu" else "bfloat16"


def engine(path: Path, quantization: str, device: torch.device, kernels: str) -> Engine:
    config = Config(model=ModelConfig(path=str(path), dtype=float_dtype(device), max_model_len=1024,
                                      quantization=quantization),
                    engine=EngineConfig(pool_bytes=256 << 20, kernels=kernels))
    return Engine(config, device)


def w1(bench: Engine, prompt: list[int], generated: int) -> tuple[float, list[float], list[int]]:
    """(decode tok/s after the first token, the seconds of each decode step, prompt + the greedy
    tokens) of one request."""
    bench.add_request(object(), prompt, SamplingParams(max_tokens=generated, temperature=0, ignore_eos=True))
    tokens, times = list(prompt), []
    while bench.has_work:
        for out in bench.step():
            tokens += out.token_ids
            times.append(time.perf_counter())
    steps = [later - earlier for earlier, later in zip(times, times[1:])]
    return (generated - 1) / (times[-1] - times[0]), steps, tokens


def decode_rounds(path: Path, prompts: list[list[int]], generated: int,
                  device: torch.device, kernels: str) -> tuple[dict, dict, list[list[int]]]:
    """Alternating W1 rounds of both variants (one per prompt): their rates, all their decode
    steps' seconds, and the float engine's sequences."""
    engines = {q: engine(path, q, device, kernels) for q in VARIANTS}
    for bench in engines.values():   # first-call costs (allocation, page faults) out of the way
        w1(bench, prompts[0][:16], 8)
    rates, steps, sequences = {q: [] for q in VARIANTS}, {q: [] for q in VARIANTS}, []
    for prompt in prompts:
        for quantization, bench in engines.items():
            rate, step_seconds, tokens = w1(bench, prompt, generated)
            rates[quantization].append(rate)
            steps[quantization] += step_seconds
            if quantization == "none":
                sequences.append(tokens)
    return rates, steps, sequences


def fast_decile(seconds: list[float]) -> float:
    """The 10th percentile of step times: a step that had the cores to itself. On this shared
    machine a step can wait a scheduler slice for a core (milliseconds, as long as a whole
    int8 step), which both variants pay alike and which shrinks their ratio toward 1."""
    return sorted(seconds)[len(seconds) // 10]


def quality(path: Path, sequences: list[list[int]], device: torch.device, kernels: str, suffix: str = "") -> dict:
    models = {}
    for quantization in VARIANTS:
        models[quantization] = load_model(ModelConfig(path=str(path), dtype=float_dtype(device),
                                                      quantization=quantization), device).model
        models[quantization].use_kernels(kernels)
    agreement = compare(models["none"], models["int8"], sequences)
    return {f"int8_top1_agreement{suffix}": agreement.top1, f"int8_mean_kl{suffix}": agreement.mean_kl,
            f"{float_dtype(device)}_top1_prob{suffix}": agreement.reference_top1_prob,
            f"quality_positions{suffix}": agreement.positions}


def trained_quality(rounds: int, generated: int, quick: bool, kernels: str) -> dict:
    """quality() on the trained checkpoint: prompts of PROMPT_TOKENS tokens cut from README.md
    at even offsets, each with the float32 engine's greedy continuation. --quick never trains (it
    must stay under a minute): without a cached checkpoint it reports no *_trained figures."""
    path = trained.checkpoint(may_train=not quick)
    if path is None:
        print("  the trained checkpoint is not cached: run once without --quick (trains it, ~10 min)")
        return {}
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(HELD_OUT.read_text()).ids
    stride = (len(ids) - PROMPT_TOKENS) // rounds
    prompts = [ids[i * stride:i * stride + PROMPT_TOKENS] for i in range(rounds)]
    cpu = torch.device("cpu")
    reference = engine(path, "none", cpu, kernels)
    return quality(path, [w1(reference, prompt, generated)[2] for prompt in prompts], cpu, kernels, "_trained")


def product_figures(rows_counts: tuple[int, ...] = (1, 8, 64, 512)) -> dict:
    """A 7B Llama layer's four products (q/k/v fused, o, gate/up fused, down), bf16 F.linear
    against the int8 kernel, each timed alone by triton's do_bench (CUDA events over repeated
    calls, the median): per row count, the layer's summed time of each and its speedup, and the
    GB/s the int8 and bf16 weights stream at for one row (the bytes that bound a decode step)."""
    import triton.testing
    from mcpd.quant import int8_cuda
    from mcpd.quant.int8 import Int8Weight, quantize
    shapes = [(3 * 4096, 4096), (4096, 4096), (2 * 11008, 4096), (4096, 11008)]
    generator = torch.Generator().manual_seed(0)
    matrices = [(torch.randn(n, k, generator=generator) * 0.02) for n, k in shapes]
    bf16 = [w.to("cuda", torch.bfloat16) for w in matrices]
    quantized = [Int8Weight(*(t.cuda() for t in quantize(w))) for w in matrices]
    weight_bytes = {"bf16": sum(w.numel() * 2 for w in bf16),
                    "int8": sum(q.values.numel() + q.scales.numel() * 4 for q in quantized)}
    figures = {}
    for rows in rows_counts:
        xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in shapes]
        seconds = {"bf16": sum(triton.testing.do_bench(lambda x=x, w=w: torch.nn.functional.linear(x, w)) for x, w in zip(xs, bf16)) / 1e3,
                   "int8": sum(triton.testing.do_bench(lambda x=x, w=w: int8_cuda.linear(x, w)) for x, w in zip(xs, quantized)) / 1e3}
        figures[f"product_{rows}row_bf16_us"] = seconds["bf16"] * 1e6
        figures[f"product_{rows}row_int8_us"] = seconds["int8"] * 1e6
        figures[f"product_{rows}row_int8_speedup"] = seconds["bf16"] / seconds["int8"]
        if rows == 1:
            for variant in ("bf16", "int8"):
                figures[f"product_1row_{variant}_gb_s"] = weight_bytes[variant] / seconds[variant] / 1e9
    return figures


def measure(quick: bool, device: torch.device = torch.device("cpu"), kernels: str = "auto") -> dict:
    path, _ = checkpoints.checkpoint()
    rounds, generated = (3, 48) if quick else (8, 128)
    rng = random.Random(0)
    vocab = checkpoints.ISSUE_SHAPE.vocab
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(rounds)]
    load_before = os.getloadavg()[0]
    rates, steps, sequences = decode_rounds(path, prompts, generated, device, kernels)
    median = statistics.median
    float_name = float_dtype(device)
    on_gpu = device.type == "cuda"
    return {f"{float_name}_decode_tok_s": median(rates["none"]), "int8_decode_tok_s": median(rates["int8"]),
            "int8_decode_speedup": median(q / f for f, q in zip(rates["none"], rates["int8"])),
            f"{float_name}_step_ms_fast_decile": fast_decile(steps["none"]) * 1e3,
            "int8_step_ms_fast_decile": fast_decile(steps["int8"]) * 1e3,
            "int8_decode_speedup_fast_decile": fast_decile(steps["none"]) / fast_decile(steps["int8"]),
            **quality(path, sequences, device, kernels),
            **(product_figures() if on_gpu else trained_quality(rounds, generated, quick, kernels)),
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "kernels": kernels, "rounds": rounds, "generated_per_round": generated,
            "threads": torch.get_num_threads(), "load_average": max(load_before, os.getloadavg()[0])}


def main() -> None:
    figures = measure(ARGS.quick, torch.device(ARGS.device), ARGS.kernels)
    for name, value in figures.items():
        print(f"  {name:32} {value:12.6g}" if isinstance(value, float) else f"  {name:32} {value:12}")
    print(json.dumps({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()

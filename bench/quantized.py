"""int8 weight-only quantization (model.quantization = "int8") against the float32 model, side by side.

    .venv/bin/python bench/quantized.py [--quick]

The model: issue 12's 55.3M Llama of bench/peerkit/checkpoints.py (8 layers, hidden 512, 8/2
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
  float32 one (teacher-forced, mcpd/models/agreement.py): top-1 agreement, mean KL(float ||
  int8) in nats, and the float model's mean top-1 probability (how peaked its distributions are).
  - the random checkpoint above (`int8_top1_agreement`, `int8_mean_kl`: the figures the tests'
    checkpoints resemble), on the decode rounds' prompts. Random weights give flat distributions
    (the float model's most likely token has ~2e-4 probability, its lead over the second ~2e-5),
    so near-ties any rounding flips decide many positions: a floor for a trained model's.
  - a briefly trained copy of it (`*_trained`; bench/peerkit/trained.py: a few hundred AdamW
    steps on the repo's docs/*.md, cached; the first run trains it, minutes), on prompts cut
    from the repo's README.md, which it was not trained on.

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

from mcpd.engine import threads

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 48 tokens (under a minute)")
    parser.add_argument("--threads", type=int, default=0, help="engine threads; 0: as a worker picks them")
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
from mcpd.models.agreement import compare  # noqa: E402

PROMPT_TOKENS = 128
HELD_OUT = Path(__file__).resolve().parent.parent / "README.md"   # the trained model's prompts
VARIANTS = ("none", "int8")   # model.quantization: the float32 baseline, then int8


def engine(path: Path, quantization: str) -> Engine:
    config = Config(model=ModelConfig(path=str(path), dtype="float32", max_model_len=1024,
                                      quantization=quantization),
                    engine=EngineConfig(pool_bytes=256 << 20))
    return Engine(config, torch.device("cpu"))


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


def decode_rounds(path: Path, prompts: list[list[int]], generated: int) -> tuple[dict, dict, list[list[int]]]:
    """Alternating W1 rounds of both variants (one per prompt): their rates, all their decode
    steps' seconds, and the float32 engine's sequences."""
    engines = {q: engine(path, q) for q in VARIANTS}
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


def quality(path: Path, sequences: list[list[int]], suffix: str = "") -> dict:
    models = {}
    for quantization in VARIANTS:
        models[quantization] = load_model(ModelConfig(path=str(path), dtype="float32", quantization=quantization),
                                          torch.device("cpu")).model
        models[quantization].use_kernels("auto")
    agreement = compare(models["none"], models["int8"], sequences)
    return {f"int8_top1_agreement{suffix}": agreement.top1, f"int8_mean_kl{suffix}": agreement.mean_kl,
            f"float32_top1_prob{suffix}": agreement.reference_top1_prob,
            f"quality_positions{suffix}": agreement.positions}


def trained_quality(rounds: int, generated: int, quick: bool) -> dict:
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
    reference = engine(path, "none")
    return quality(path, [w1(reference, prompt, generated)[2] for prompt in prompts], "_trained")


def measure(quick: bool) -> dict:
    path, _ = checkpoints.checkpoint()
    rounds, generated = (3, 48) if quick else (8, 128)
    rng = random.Random(0)
    vocab = checkpoints.ISSUE_SHAPE.vocab
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(rounds)]
    load_before = os.getloadavg()[0]
    rates, steps, sequences = decode_rounds(path, prompts, generated)
    median = statistics.median
    return {"float32_decode_tok_s": median(rates["none"]), "int8_decode_tok_s": median(rates["int8"]),
            "int8_decode_speedup": median(q / f for f, q in zip(rates["none"], rates["int8"])),
            "float32_step_ms_fast_decile": fast_decile(steps["none"]) * 1e3,
            "int8_step_ms_fast_decile": fast_decile(steps["int8"]) * 1e3,
            "int8_decode_speedup_fast_decile": fast_decile(steps["none"]) / fast_decile(steps["int8"]),
            **quality(path, sequences), **trained_quality(rounds, generated, quick),
            "rounds": rounds, "generated_per_round": generated,
            "threads": torch.get_num_threads(), "load_average": max(load_before, os.getloadavg()[0])}


def main() -> None:
    figures = measure(ARGS.quick)
    for name, value in figures.items():
        print(f"  {name:32} {value:12.6g}" if isinstance(value, float) else f"  {name:32} {value:12}")
    print(json.dumps({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()

"""Decode on a GPU: mcpd's engine against transformers' generate() on the same card, side by side.

    python bench/gpu_decode.py [--quick] [--dtype bfloat16|float32]

The model is issue 12's 55.3M Llama (bench/peerkit/checkpoints.py, random weights), on
cuda:0. W1: one request, a 128-token prompt, 128 tokens generated greedily (EOS ignored);
decode tok/s over the tokens after the first. W2: 32 such requests at once (mcpd batches them;
transformers gets them as one padded batch), generated tok/s. Each side warms up once, then the
median of the rounds. Both sides launch a kernel per op (mcpd has no CUDA graphs yet), so at
this size both are bound by launches, not by the card: the ratio is what mcpd's scheduling and
step overhead cost against a plain generate loop. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from peerkit.checkpoints import checkpoint  # noqa: E402

from mcpd.config import Config, EngineConfig, ModelConfig  # noqa: E402
from mcpd.engine import Engine, SamplingParams  # noqa: E402

PROMPT_TOKENS = 128


def mcpd_decode(engine: Engine, prompts: list[list[int]], generated: int) -> float:
    """Generated tok/s after each request's first token (W1: one prompt; W2: many)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, SamplingParams(max_tokens=generated, temperature=0, ignore_eos=True))
    first = None
    while engine.has_work:
        engine.step()
        first = first or time.perf_counter()
    return len(prompts) * (generated - 1) / (time.perf_counter() - first)


def hf_decode(model, prompts: list[list[int]], generated: int) -> float:
    """The same through generate(): its whole time, less one first-token (prefill) call."""
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=generated, min_new_tokens=generated,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    return len(prompts) * (generated - 1) / (time.perf_counter() - started - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 64 tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    if not torch.cuda.is_available():   # `make bench` runs every bench; most machines here have no GPU
        print("no CUDA device here: nothing to measure")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    rounds, generated = (3, 64) if args.quick else (5, 128)
    dtype = getattr(torch, args.dtype)
    path, _ = checkpoint(dtype=dtype)
    engine = Engine(Config(model=ModelConfig(path=str(path), dtype=args.dtype, max_model_len=1024),
                           engine=EngineConfig(pool_bytes=2 << 30)), torch.device("cuda"))
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 32000, (32, PROMPT_TOKENS), generator=generator).tolist()
    figures = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "generated": generated}
    for workload, batch in (("w1", prompts[:1]), ("w2_32", prompts)):
        mcpd_decode(engine, batch, 8), hf_decode(hf, batch, 8)   # warm-up: kernels picked, memory taken
        ours = statistics.median(mcpd_decode(engine, batch, generated) for _ in range(rounds))
        theirs = statistics.median(hf_decode(hf, batch, generated) for _ in range(rounds))
        figures |= {f"{workload}_mcpd_tok_s": round(ours, 1), f"{workload}_transformers_tok_s": round(theirs, 1),
                    f"{workload}_ratio": round(ours / theirs, 3)}
        print(f"{workload}: mcpd {ours:.0f} tok/s, transformers {theirs:.0f} tok/s ({ours / theirs:.2f}x)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

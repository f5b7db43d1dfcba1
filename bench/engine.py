"""The engine alone, in-process, on the 55.3M bench Llama's shape, against the roofline measured in the same run.

    .venv/bin/python bench/engine.py [--quick] [--dtypes float32,bfloat16] [--kernels auto|native|native-avx2|...]

The model: 8 layers, hidden 512, 8 query / 2 KV heads of 64, intermediate 1408, vocab 32000
(55.3M parameters), random weights written once as a safetensors checkpoint in a temporary
directory and loaded the way the worker loads any checkpoint. Every prompt is random token ids
drawn for that run, so nothing hits the prefix cache unless the workload means it to. Greedy,
EOS ignored. Per dtype:

- W1: one request, a 128-token prompt, 128 tokens generated. TTFT is add_request to the first
  token; decode tok/s counts the 127 tokens after it. Judged against the bandwidth limit: the
  bytes of weights one decode step must read (every layer and the LM head; not the embedding,
  of which a step reads one row) over read_gbps().
- prefill: a 1,600-token history in the prefix cache, then history + 170 new tokens (W3's turn
  10 on a context): the time of that one prefill step, judged against matmul_gflops() in the
  model's dtype for the FLOPs the step does (projections and MLPs of 170 tokens, their causal
  attention over the history, one row of the LM head).
- W2: 8 and 32 such requests at once: generated tok/s from the first add_request to the last
  token (their prefills included), judged by the FLOPs done against matmul_gflops(). --quick
  generates 32 tokens per stream, so prefill weighs more in its figures.
- one-token request: a 1-token prompt, max_tokens 1, add_request to its final output.
- contention: W1 decode with a process spinning on one core, over W1 idle, in alternating
  rounds (float32 only; the figure is about threads, not the dtype).
- baseline: W1 float32 on engine.kernels = torch (torch's own ops: the engine before the native
  kernels) interleaved with the default kernels, and the speed-up; and W1 float32 on weights left
  on 4 KiB pages (engine.huge_pages = false) interleaved with the default, and its speed-up.

The roofline is measured right before and after each round (the better of the two, each the
best of its repeats): this machine is shared, and a limit taken minutes earlier misjudges a
figure by tens of percent. Figures and fractions are medians over rounds. Threads are set up as
the worker sets them up (mcpd.cpu.threads), before torch is imported. The last line is one
JSON object; bf16 figures carry the prefix bf16_.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mcpd.config import WorkersConfig
from mcpd.cpu import threads
from mcpd.cpu import features


def default_dtypes() -> str:
    """bfloat16 only where the CPU has bf16 instructions: without them torch's bf16 products run
    at ~0.1 GFLOP/s (a 2048 product took 122 s on an AVX2 EPYC) and the roofline alone would
    take many minutes. Ask for it with --dtypes to measure it anyway."""
    return "float32,bfloat16" if features.has_bf16() else "float32"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    parser.add_argument("--dtypes", default=default_dtypes(),
                        help="default: float32, and bfloat16 where the CPU computes it natively")
    parser.add_argument("--kernels", default="auto", help="engine.kernels: auto, native, native-amx, "
                                                         "native-avx512, native-avx2 or torch")
    parser.add_argument("--wait-policy", default=WorkersConfig.wait_policy, help="brief, passive or active")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


ARGS = parse_args()   # before torch: the wait policy is OpenMP's environment
THREADS, _ = threads.configure(workers=1, index=0, requested=0, wait_policy=ARGS.wait_policy)

import torch  # noqa: E402  after the thread setup: OpenMP reads its environment once, at load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import matmul_gflops, read_gbps  # noqa: E402

from mcpd.config import Config, EngineConfig, ModelConfig  # noqa: E402
from mcpd.engine import Engine, SamplingParams  # noqa: E402

SHAPE = {"hidden": 512, "intermediate": 1408, "layers": 8, "heads": 8, "kv_heads": 2, "head_dim": 64,
         "vocab": 32000}
PROMPT_TOKENS, GENERATED = 128, 128
QUICK_W2_GENERATED = 32   # --quick: W2's streams generate this many (W1 stays at 128)
HISTORY_TOKENS, TURN_TOKENS = 1600, 170


def write_checkpoint(directory: Path) -> Path:
    """A random Llama of SHAPE as a Hugging Face directory (float32 weights, a word-level tokenizer)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    s = SHAPE
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": s["hidden"],
              "intermediate_size": s["intermediate"], "num_hidden_layers": s["layers"],
              "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
              "head_dim": s["head_dim"], "vocab_size": s["vocab"], "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
              "bos_token_id": 1, "eos_token_id": 2}
    (directory / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)

    def weight(*shape):
        return torch.randn(*shape, generator=generator) * 0.02

    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    tensors = {"model.embed_tokens.weight": weight(s["vocab"], s["hidden"]),
               "lm_head.weight": weight(s["vocab"], s["hidden"]), "model.norm.weight": torch.ones(s["hidden"])}
    for layer in range(s["layers"]):
        prefix = f"model.layers.{layer}."
        shapes = {"self_attn.q_proj": (q, s["hidden"]), "self_attn.k_proj": (kv, s["hidden"]),
                  "self_attn.v_proj": (kv, s["hidden"]), "self_attn.o_proj": (s["hidden"], q),
                  "mlp.gate_proj": (s["intermediate"], s["hidden"]), "mlp.up_proj": (s["intermediate"], s["hidden"]),
                  "mlp.down_proj": (s["hidden"], s["intermediate"])}
        tensors.update({f"{prefix}{name}.weight": weight(*shape) for name, shape in shapes.items()})
        tensors[f"{prefix}input_layernorm.weight"] = torch.ones(s["hidden"])
        tensors[f"{prefix}post_attention_layernorm.weight"] = torch.ones(s["hidden"])
    save_file(tensors, str(directory / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(s["vocab"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))
    return directory


class Model:
    """Parameter counts and FLOPs of SHAPE."""
    s = SHAPE
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layer_params = s["hidden"] * (q + 2 * kv) + q * s["hidden"] + 3 * s["hidden"] * s["intermediate"]
    linear_params = s["layers"] * layer_params        # what every token runs through
    head_params = s["vocab"] * s["hidden"]

    @classmethod
    def decode_bytes(cls, itemsize: int) -> int:
        """Weights one decode step reads: every layer's matrices and the LM head."""
        return (cls.linear_params + cls.head_params) * itemsize

    @classmethod
    def flops(cls, new_tokens: int, context_before: int, sampled_rows: int) -> float:
        """One sequence computing new_tokens after context_before cached ones, sampling sampled_rows."""
        attended = sum(context_before + i + 1 for i in range(new_tokens))   # causal
        attention = 4 * attended * cls.s["heads"] * cls.s["head_dim"] * cls.s["layers"]
        return 2 * cls.linear_params * new_tokens + attention + 2 * cls.head_params * sampled_rows


class Bench:
    def __init__(self, path: Path, dtype: str, kernels: str, seed: int, huge_pages: bool = True) -> None:
        config = Config(model=ModelConfig(path=str(path), dtype=dtype, max_model_len=4096),
                        engine=EngineConfig(pool_bytes=512 << 20, kernels=kernels, huge_pages=huge_pages))
        self.engine = Engine(config, torch.device("cpu"))
        self.rng = random.Random(seed)
        self.keys = iter(range(1 << 62))

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(3, SHAPE["vocab"]) for _ in range(length)]

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float], list[float]]:
        """Run prompts together to completion: (seconds in all, each one's first-token time, each
        one's last-token time), times from the first add_request."""
        started = time.perf_counter()
        keys = [next(self.keys) for _ in prompts]
        for key, prompt in zip(keys, prompts):
            self.engine.add_request(key, prompt, self.params(max_tokens))
        first, last = {}, {}
        while self.engine.has_work:
            outputs = self.engine.step()
            now = time.perf_counter() - started
            for out in outputs:
                if out.token_ids:
                    first.setdefault(out.key, now)
                    last[out.key] = now
        return time.perf_counter() - started, [first[k] for k in keys], [last[k] for k in keys]

    def w1(self) -> tuple[float, float]:
        """(TTFT ms, decode tok/s) of one request."""
        _, first, last = self.run([self.prompt(PROMPT_TOKENS)], GENERATED)
        return first[0] * 1e3, (GENERATED - 1) / (last[0] - first[0])

    def w2(self, streams: int, generated: int) -> float:
        seconds, _, _ = self.run([self.prompt(PROMPT_TOKENS) for _ in range(streams)], generated)
        return streams * generated / seconds

    def warm_up(self) -> None:
        """First-call costs (allocation, page faults, the first prefill) out of the way."""
        self.run([self.prompt(PROMPT_TOKENS)], 8)

    def turn_prefill_ms(self) -> float:
        history = self.prompt(HISTORY_TOKENS)
        self.run([history], 1)
        _, first, _ = self.run([history + self.prompt(TURN_TOKENS)], 1)
        return first[0] * 1e3

    def one_token_ms(self) -> float:
        seconds, _, _ = self.run([self.prompt(1)], 1)
        return seconds * 1e3


def spinner() -> subprocess.Popen:
    """A process burning the last core this one owns. Of the cores the engine's threads own, not
    of this thread's affinity: OpenMP binds the main thread to the first, so that was always the
    main thread's own core, and the figure measured a neighbour there only."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(hog.pid, {max(threads.owned_cores())})
    return hog


def between_limits(workloads: list, limit) -> list[tuple[object, float]]:
    """Run the workloads one after another with the limit measured before, between and after
    them: each result with the better of the limits on either side. This machine is shared and
    its state drifts within a run: a figure is judged against the roofline of its own moment,
    not one taken a minute earlier."""
    limits, results = [limit()], []
    for workload in workloads:
        results.append(workload())
        limits.append(limit())
    return [(result, max(limits[i], limits[i + 1])) for i, result in enumerate(results)]


def measure(bench: Bench, dtype: str, rounds: int, repeats: int, w2_generated: int) -> dict:
    bytes_per_token = Model.decode_bytes(bench.engine.dtype.itemsize)
    gbps = lambda: read_gbps(repeats=repeats)   # noqa: E731
    gflops = lambda: matmul_gflops(getattr(torch, dtype), repeats=repeats)   # noqa: E731
    bench.warm_up()
    w1 = between_limits([bench.w1] * rounds, gbps)
    turn = between_limits([bench.turn_prefill_ms] * rounds, gflops)
    w2 = between_limits([lambda n=n: (n, bench.w2(n, w2_generated)) for n in (8, 32)] * max(1, rounds // 2), gflops)
    turn_flops = Model.flops(TURN_TOKENS, HISTORY_TOKENS, 1)
    stream_flops = Model.flops(PROMPT_TOKENS + w2_generated - 1, 0, w2_generated)
    median = statistics.median
    figures = {
        "w1_decode_tok_s": median(rate for (_, rate), _ in w1),
        "w1_decode_roofline_frac": median(rate * bytes_per_token / (g * 1e9) for (_, rate), g in w1),
        "w1_ttft_ms": median(ttft for (ttft, _), _ in w1),
        "turn_prefill_ms": median(ms for ms, _ in turn),
        "prefill_compute_roofline_frac": median(turn_flops / (ms / 1e3) / (f * 1e9) for ms, f in turn),
        "one_token_engine_ms": median(bench.one_token_ms() for _ in range(rounds * 3)),
        "weight_bytes_per_token": bytes_per_token, "prefill_gflop": turn_flops / 1e9,
        "read_gbps_median": median(g for _, g in w1), "matmul_gflops_median": median(f for _, f in turn),
    }
    for n in (8, 32):
        runs = [(rate, f) for (streams, rate), f in w2 if streams == n]
        figures[f"w2_{n}_tok_s"] = median(rate for rate, _ in runs)
        figures[f"w2_{n}_compute_roofline_frac"] = median(rate / w2_generated * stream_flops / (f * 1e9)
                                                          for rate, f in runs)
    return figures


def contention(bench: Bench, rounds: int) -> dict:
    """W1 decode with a process spinning on one core against W1 idle, alternating rounds."""
    idle, busy = [], []
    for _ in range(rounds):
        idle.append(bench.w1()[1])
        hog = spinner()
        try:
            time.sleep(0.2)
            busy.append(bench.w1()[1])
        finally:
            hog.kill()
            hog.wait()
    return {"w1_decode_tok_s_idle": statistics.median(idle), "w1_decode_tok_s_one_core_busy": statistics.median(busy),
            "contention_keep_frac": statistics.median(busy) / statistics.median(idle)}


def torch_kernels_baseline(native: Bench, path: Path, rounds: int, seed: int) -> dict:
    """W1 on engine.kernels = torch (torch's own ops, the engine as it was before the native
    kernels), interleaved with the default kernels: the speed-up of the same run."""
    portable = Bench(path, "float32", "torch", seed)
    portable.warm_up()
    runs = [(native.w1(), portable.w1()) for _ in range(rounds)]
    return {"w1_decode_tok_s_torch_kernels": statistics.median(p[1] for _, p in runs),
            "w1_ttft_ms_torch_kernels": statistics.median(p[0] for _, p in runs),
            "w1_decode_speedup_vs_torch_kernels": statistics.median(n[1] / p[1] for n, p in runs)}


def small_pages_baseline(huge: Bench, path: Path, rounds: int, seed: int) -> dict:
    """W1 float32 on weights left on 4 KiB pages (engine.huge_pages = false), interleaved with
    the default: what the copy onto 2 MiB pages buys in the same run."""
    small = Bench(path, "float32", ARGS.kernels, seed, huge_pages=False)
    small.warm_up()
    runs = [(huge.w1(), small.w1()) for _ in range(rounds)]
    return {"w1_decode_tok_s_4k_pages": statistics.median(s[1] for _, s in runs),
            "w1_decode_speedup_vs_4k_pages": statistics.median(h[1] / s[1] for h, s in runs),
            "weight_pages": huge.engine.pages_reason}


def main() -> None:
    args = ARGS
    rounds, repeats, w2_generated = (2, 2, QUICK_W2_GENERATED) if args.quick else (5, 10, GENERATED)
    result = {"threads": THREADS, "wait_policy": args.wait_policy, "kernels": args.kernels, "quick": args.quick,
              "w2_generated_per_stream": w2_generated}
    with tempfile.TemporaryDirectory(prefix="mcpd-bench-engine-") as tmp:
        path = write_checkpoint(Path(tmp))
        for dtype in args.dtypes.split(","):
            bench = Bench(path, dtype, args.kernels, args.seed)
            figures = {"kernels_used": bench.engine.stats()["kernels"]}   # the set auto took, its ISA
            figures.update(measure(bench, dtype, rounds, repeats, w2_generated))
            if dtype == "float32":
                figures.update(contention(bench, rounds // 2 if args.quick else rounds))
                figures.update(torch_kernels_baseline(bench, path, rounds // 2 if args.quick else rounds, args.seed))
                figures.update(small_pages_baseline(bench, path, rounds, args.seed))
            del bench   # its pool and weights, before the next dtype's
            prefix = "" if dtype == "float32" else "bf16_"
            print(f"{dtype}:")
            for name, value in figures.items():
                print(f"  {name:36} {value:12.3f}" if isinstance(value, float) else f"  {name:36} {value}")
            result.update({prefix + name: value for name, value in figures.items()})
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()

"""The machine's limits, measured in the same run as the figures they judge.

Two numbers bound an engine on a CPU (or one GPU): how fast memory can be read (a decode step at
batch 1 must read every weight once) and how fast a large matrix product runs (a big batch or a
long prefill is bound by FLOPs). Both are measured with torch on the threads the engine would use,
best of several repeats, because these machines are noisy and a limit is the best the machine did,
not its average.

    .venv/bin/python bench/roofline.py [--quick] [--threads N] [--device cpu|cuda]

Other benchmarks import read_gbps() and matmul_gflops() and divide by them.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from mcpd.memory import huge_pages

READ_BYTES = 512 << 20       # well past every cache level: what a weight read of a real model sees
MATMUL_SIZE = 2048           # large enough for the GEMM kernel's peak, small enough to take ~0.1 s


def _best_seconds(fn, repeats: int) -> float:
    fn()   # warm-up: first-touch page faults, kernel selection
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def read_gbps(device: str = "cpu", repeats: int = 10) -> float:
    """Bytes per second of a streaming read (a sum over a 512 MiB float32 tensor), in GB/s. On the
    CPU the tensor lies on 2 MiB pages, as the engine's weights do (engine.huge_pages, on by
    default): the limit of the read a decode step does. In the same minutes on the issues' VM the
    sum read 57-63 GB/s on 2 MiB pages against 38-52 on 4 KiB ones (the TLB; a fresh tensor got
    some huge pages or none, by chance), so a 4 KiB read flattered every engine judged by it."""
    data = (huge_pages.arena(READ_BYTES).view(torch.float32).fill_(1.0) if device == "cpu"
            else torch.ones(READ_BYTES // 4, dtype=torch.float32, device=device))
    seconds = _best_seconds(lambda: data.sum(), repeats)
    return READ_BYTES / seconds / 1e9


def matmul_gflops(dtype: torch.dtype = torch.float32, device: str = "cpu", repeats: int = 10) -> float:
    """FLOPs per second of a square matrix product of MATMUL_SIZE in dtype, in GFLOP/s."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device).to(dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device).to(dtype)
    seconds = _best_seconds(lambda: a @ b, repeats)
    return 2 * MATMUL_SIZE ** 3 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else 20
    figures = {"device": args.device, "threads": torch.get_num_threads(),
               "read_gbps": round(read_gbps(args.device, repeats), 1),
               "matmul_fp32_gflops": round(matmul_gflops(torch.float32, args.device, repeats), 1),
               "matmul_bf16_gflops": round(matmul_gflops(torch.bfloat16, args.device, repeats), 1)}
    for name, value in figures.items():
        print(f"{name:>20}: {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

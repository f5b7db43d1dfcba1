"""Decode throughput through the daemon: 32 concurrent streams against 1, same model, same run.

    python bench/batching.py [--quick] [--streams 32] [--tokens 64]

Each stream generates the same number of tokens from a short prompt (ignore_eos), so the time is
decode time; throughput counts tokens between each stream's first and last chunk. Last line
JSON: decode_throughput_ratio_32_vs_1 (target >= 8 on CPU with the embedded model).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from mcpd.client import AsyncClient
from mcpd.testing import Daemon


async def one_stream(client: AsyncClient, index: int, tokens: int) -> tuple[float, float, int]:
    """(time of first token, time of last token, tokens after the first)."""
    first = last = None
    count = 0
    async for chunk in client.stream(f"stream {index}:", max_tokens=tokens, temperature=0, ignore_eos=True):
        now = time.perf_counter()
        first = first or now
        last = now
        count += len(chunk.token_ids)
    return first, last, count - 1


async def decode_rate(endpoint: str, streams: int, tokens: int) -> float:
    """Tokens per second decoded by `streams` concurrent streams (after each one's first token)."""
    async with AsyncClient(endpoint, timeout=600) as client:
        runs = await asyncio.gather(*[one_stream(client, i, tokens) for i in range(streams)])
    started = min(r[0] for r in runs)
    finished = max(r[1] for r in runs)
    return sum(r[2] for r in runs) / (finished - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens (well under a minute)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=None)
    args = parser.parse_args()
    tokens = args.tokens or (48 if args.quick else 256)

    daemon = Daemon(engine={"max_num_seqs": max(64, args.streams)}).start()
    try:
        asyncio.run(decode_rate(daemon.endpoint, 2, 8))   # warm-up: first-call costs out of the way
        single = asyncio.run(decode_rate(daemon.endpoint, 1, tokens))
        batched = asyncio.run(decode_rate(daemon.endpoint, args.streams, tokens))
        device = daemon.status()["devices"][0].get("device", "?")
    finally:
        daemon.stop()
        daemon.cleanup()

    print(f"device {device}, {tokens} tokens per stream")
    print(f"1 stream:  {single:10.1f} tokens/s")
    print(f"{args.streams} streams: {batched:10.1f} tokens/s")
    print(json.dumps({"decode_throughput_ratio_32_vs_1": round(batched / single, 2),
                      "tokens_per_s_1": round(single, 1), "tokens_per_s_32": round(batched, 1),
                      "streams": args.streams, "tokens_per_stream": tokens, "device": device,
                      "quick": args.quick}))


if __name__ == "__main__":
    main()

"""Restart to first token: a worker SIGKILLed after a long chat, and the chat's next turn.

    python bench/restart.py [--quick] [--device cpu|cuda] [--history TOKENS]

One worker on the device serves a chat whose history is about --history tokens (2,048 by
default: one long turn, then short ones). Its worker is SIGKILLed, and at once the chat's next
turn is sent (max_tokens 1): `restart_to_first_token_s` is from the kill to that token's reply.
Side by side in one run, three ways to come back:

- pool: the shared device pool and a standby (pool.shared, workers.standby): the promoted
  standby maps its predecessor's weights and committed KV blocks in the pool (on a GPU, the
  keeper's CUDA IPC allocation) and the turn computes only its own tokens;
- host cache: private pools, no standby (a fresh process loads the model), the history's KV
  written through to the host cache and loaded back from it;
- recompute: the same with the host cache off: the turn recomputes the whole history.

Each scenario also reports `recomputed_tokens` (history tokens the turn computed again) and
`host_kv_loaded` (blocks loaded from the host cache). The embedded model (4 layers, hidden
256) is small, so on a GPU a recompute is cheap next to a process start: the figure that
grows with the model is how much of the history comes back without being computed.
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

from mcpd.protocol.codes import MCPDError
from mcpd.testing import Daemon

KV_BLOCK_TOKENS = 16   # engine.kv_block_size's default
SCENARIOS = {
    "pool": ({"shared": True}, {"standby": True}, {}),
    "host_cache": ({"shared": False}, {"standby": False}, {}),
    "recompute": ({"shared": False}, {"standby": False}, {"enabled": False}),
}


def history_turns(tokens: int) -> list[str]:
    """One long turn, then nine short ones: about `tokens` tokens of the byte tokenizer."""
    return [" ".join(f"w{i % 97}" for i in range(tokens // 4))] + [f" turn {i}: go on" for i in range(9)]


def restart_to_first_token(daemon: Daemon, context) -> float:
    """SIGKILL the worker, then send the next turn until it is answered; seconds from the kill."""
    old_pid = daemon.pid_of("worker")
    killed = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    while True:
        try:
            context.generate(" and then?", max_tokens=1, temperature=0, ignore_eos=True)
            return time.monotonic() - killed
        except MCPDError as e:   # WORKER_LOST or UNAVAILABLE while no worker runs: the client would retry
            if time.monotonic() - killed > 300:
                raise
            time.sleep(0.01)


def successor_figures(daemon: Daemon) -> dict:
    """The restarted worker's counters, once its report has come (it generated one token, its
    predecessor dozens)."""
    daemon.wait_until(lambda: daemon.status()["devices"][0]["tokens_generated"] == 1, 60, "the successor's report")
    return daemon.status()["devices"][0]


def scenario(name: str, device: str, history: int) -> dict:
    pool, workers, host_cache = SCENARIOS[name]
    daemon = Daemon(workers={"count": 1, "device": device, "restart_backoff_s": 0.2, **workers}, pool=pool,
                    cache=host_cache, model={"max_model_len": history + 512}).start()
    try:
        with daemon.client(timeout=300, tenant="chat") as client:
            context = client.context("bench")
            for text in history_turns(history):
                context.generate(text, max_tokens=8, temperature=0, ignore_eos=True)
            if workers["standby"]:
                daemon.wait_until(lambda: "standing by for worker 0" in daemon.log(), 120, "a standby")
            tokens = len(context.tokens)
            seconds = restart_to_first_token(daemon, context)
            after = successor_figures(daemon)
    finally:
        daemon.stop()
        daemon.cleanup()
    reusable = (tokens - 1) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS   # what an uninterrupted worker reuses
    hits = after["prefix_cache_hits"]
    return {"restart_to_first_token_s": round(seconds, 3), "history_tokens": tokens,
            "recomputed_tokens": reusable - hits, "host_kv_loaded": after["host_kv_loaded"],
            "kv_blocks_adopted": after["pool"].get("kv_blocks_adopted", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 512-token history (under a minute on the CPU)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--history", type=int, default=2048, help="the chat's history in tokens")
    args = parser.parse_args()
    history = 512 if args.quick else args.history
    results = {name: scenario(name, args.device, history) for name in SCENARIOS}
    for name, result in results.items():
        print(f"{name:>10}: first token {result['restart_to_first_token_s']:.2f} s after the kill, "
              f"{result['recomputed_tokens']} of {result['history_tokens']} history tokens recomputed, "
              f"{result['host_kv_loaded']} host blocks loaded, {result['kv_blocks_adopted']} device blocks adopted")
    pool = results["pool"]
    figures = {"device": args.device, "history_tokens": pool["history_tokens"],
               **{f"{name}_{key}": value for name, result in results.items() for key, value in result.items()
                  if key != "history_tokens"},
               "restart_ratio_vs_recompute": round(pool["restart_to_first_token_s"]
                                                   / results["recompute"]["restart_to_first_token_s"], 3)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

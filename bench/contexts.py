"""Contexts against stateless requests, side by side in one run through the daemon.

    python bench/contexts.py [--quick]

1. Chat: nine turns build ~2k tokens of history in a context; turn 10's time to first token
   (the daemon prefills only the new tokens) against a stateless generate of the whole history
   under another tenant (its prefix cache cannot help: a true recompute), and the bytes the
   client sends for turn 10 against resending the history. Then the same turn 10 on a copy of
   the chat after its worker was SIGKILLed: the restarted worker has no KV on its device and
   loads the history's blocks from the host shared-memory cache.
2. Fields: a 64 MB float32 field with 1% of elements changed: the delta's payload against the
   field, and the time of mirror.sync() against a full resend of the field.
Last line JSON: ttft_speedup_vs_recompute (target >= 10), ttft_speedup_shm_vs_recompute,
wire_bytes_ratio_vs_resend (>= 20), delta_payload_frac (<= 0.03), delta_sync_speedup (>= 10).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time

import numpy as np

from mcpd.client import Client
from mcpd.protocol import delta as codec
from mcpd.protocol import wire
from mcpd.testing import Daemon

TURN_PROMPT_CHARS = 160
TURN_OUTPUT_TOKENS = 64
FIELD_ELEMENTS = 16 << 20   # 64 MB of float32


def first_token_seconds(stream) -> float:
    started = time.perf_counter()
    for chunk in stream:
        if chunk.token_ids:
            elapsed = time.perf_counter() - started
            break
    for _ in stream:   # let it finish so the next measurement starts on an idle engine
        pass
    return elapsed


def turn_text(turn: int) -> str:
    return (f" Turn {turn}: " + "tell me about the weather and the sea " * 8)[:TURN_PROMPT_CHARS]


def chat_figures(daemon: Daemon) -> dict:
    endpoint = daemon.endpoint
    with Client(endpoint, tenant="bench-context") as client, Client(endpoint, tenant="bench-recompute") as cold:
        ctx = client.context("chat")
        for turn in range(1, 10):
            ctx.generate(turn_text(turn), max_tokens=TURN_OUTPUT_TOKENS, temperature=0, ignore_eos=True)
        history = [int(t) for t in ctx.tokens]
        twin = client.context("chat-twin")   # the same history, for turn 10 on a worker without its KV
        twin["tokens"] = ctx.tokens.copy()
        twin.sync()
        prompt = turn_text(10)
        turn_args = {"prompt": prompt, "context": "chat", "base": ctx.version, "max_tokens": 8,
                     "temperature": 0, "ignore_eos": True, "stream": True}
        reuse_s = first_token_seconds(client.generate(**{k: v for k, v in turn_args.items() if k != "stream"},
                                                      stream=True))
        full_ids = history + list(prompt.encode())
        recompute_s = first_token_seconds(cold.generate(prompt_token_ids=full_ids, max_tokens=8, temperature=0,
                                                        ignore_eos=True, stream=True))
        kill_worker(daemon)
        # Warm the new worker up (first forward pass) on another tenant: its device holds no chat KV.
        cold.generate(prompt_token_ids=[1, 2, 3], max_tokens=2, temperature=0, ignore_eos=True)
        twin_args = {**turn_args, "context": "chat-twin", "base": twin.version}
        shm_s = first_token_seconds(client.generate(**twin_args))
    context_bytes = len(wire.encode_request("generate", 10, turn_args))
    # The stateless client's cheapest resend: token ids, or the text when it is shorter.
    resend_ids = len(wire.encode_request("generate", 10, {**_stateless(turn_args), "prompt_token_ids": full_ids}))
    text = bytes(t for t in full_ids if t < 256).decode("utf-8", "replace")   # the byte tokenizer's text
    resend_text = len(wire.encode_request("generate", 10, {**_stateless(turn_args), "prompt": text}))
    return {"history_tokens": len(history), "ttft_reuse_ms": reuse_s * 1e3, "ttft_recompute_ms": recompute_s * 1e3,
            "ttft_shm_ms": shm_s * 1e3, "turn_bytes": context_bytes, "resend_bytes": min(resend_ids, resend_text)}


def kill_worker(daemon: Daemon) -> None:
    """SIGKILL the only worker and wait for its successor: the chat's KV is then only in the host cache."""
    old = daemon.pid_of("worker")
    os.kill(old, signal.SIGKILL)
    daemon.wait_until(lambda: daemon.pid_of("worker") not in (None, old) and daemon.status()["state"] == "ready",
                      120, "the worker restarted")


def _stateless(args: dict) -> dict:
    return {k: v for k, v in args.items() if k not in ("context", "base", "prompt")}


def field_figures(endpoint: str, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    field = rng.standard_normal(FIELD_ELEMENTS, dtype=np.float32)
    with Client(endpoint, timeout=300) as client:
        mirror = client.context("field")
        full_times, delta_times, payloads = [], [], []
        # One round more than measured: the first fills the daemon's and the host cache's memory
        # for the first time (page faults, a cost of the first sync only, on both sides).
        for _ in range(repeats + 1):
            mirror["w"] = field.copy()   # fresh values: the whole field goes over the wire
            started = time.perf_counter()
            mirror.sync()
            full_times.append(time.perf_counter() - started)
            changed = field.copy()
            changed[rng.choice(FIELD_ELEMENTS, FIELD_ELEMENTS // 100, replace=False)] += 1.0
            payloads.append(len(codec.diff("w", mirror["w"], changed).data))
            mirror["w"] = changed
            started = time.perf_counter()
            mirror.sync()
            delta_times.append(time.perf_counter() - started)
            field = rng.standard_normal(FIELD_ELEMENTS, dtype=np.float32)
    return {"field_bytes": FIELD_ELEMENTS * 4, "delta_payload_bytes": statistics.median(payloads[1:]),
            "full_sync_ms": statistics.median(full_times[1:]) * 1e3,
            "delta_sync_ms": statistics.median(delta_times[1:]) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition (well under a minute)")
    args = parser.parse_args()
    daemon = Daemon(limits={"max_message_bytes": 128 << 20},
                    model={"max_model_len": 4096}, engine={"pool_bytes": 256 << 20}).start()
    try:
        chat = chat_figures(daemon)
        fields = field_figures(daemon.endpoint, 1 if args.quick else 3)
    finally:
        daemon.stop()
        daemon.cleanup()

    print(f"chat turn 10 over {chat['history_tokens']} tokens of history:")
    print(f"  first token: {chat['ttft_reuse_ms']:.1f} ms with the context's KV, "
          f"{chat['ttft_recompute_ms']:.1f} ms recomputing it")
    print(f"  on a restarted worker, history KV from the host cache: {chat['ttft_shm_ms']:.1f} ms")
    print(f"  client sends {chat['turn_bytes']} bytes, against {chat['resend_bytes']} resending the history")
    print(f"64 MB field, 1% changed: delta payload {fields['delta_payload_bytes']:.0f} bytes; "
          f"sync {fields['delta_sync_ms']:.1f} ms against {fields['full_sync_ms']:.1f} ms full resend")
    print(json.dumps({
        "ttft_speedup_vs_recompute": round(chat["ttft_recompute_ms"] / chat["ttft_reuse_ms"], 2),
        "ttft_speedup_shm_vs_recompute": round(chat["ttft_recompute_ms"] / chat["ttft_shm_ms"], 2),
        "wire_bytes_ratio_vs_resend": round(chat["resend_bytes"] / chat["turn_bytes"], 2),
        "delta_payload_frac": round(fields["delta_payload_bytes"] / fields["field_bytes"], 4),
        "delta_sync_speedup": round(fields["full_sync_ms"] / fields["delta_sync_ms"], 2),
        **{k: round(v, 2) for k, v in {**chat, **fields}.items()}, "quick": args.quick}))


if __name__ == "__main__":
    main()

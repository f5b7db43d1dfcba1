"""mcpd against the servers people would pick instead (vLLM, llama.cpp), side by side, one checkpoint.

    .venv/bin/python bench/peers.py --setup        # once, outside CI: peer venvs, vocab, GGUFs (niced)
    .venv/bin/python bench/peers.py [--quick] [--http] [--dtype float32|bfloat16] [--rounds 5] [--cache-dir DIR]
                                    [--isa native|avx2]

Every system serves the same random Llama-style checkpoint (bench/peerkit/checkpoints.py: 55.3M parameters,
Llama-2 vocabulary) on 127.0.0.1: mcpd through the real daemon and its native client, the peers
(bench/peerkit/servers.py) through their OpenAI-compatible HTTP APIs. All requests are greedy with
EOS ignored (llama.cpp: min_tokens = max_tokens), the same prompts and token counts for every
system; each server is warmed up first, and the warm-up checks that every server counts the same
prompt tokens and generates the same greedy text as mcpd. Workloads:

  W1  1 client, 128-token prompt, 128 generated, streamed: decode tok/s, time to first token (the
      median of W1's own and TTFT_SAMPLES - 1 more prompts of its length streamed for one token:
      one prefill a round swings by a third on this shared machine)
  W2  8 and 32 concurrent clients, the same requests: generated tok/s
  W3  10-turn chat, ~160 new tokens a turn, 16 generated: turn 10's time to first token. mcpd keeps
      the chat in a daemon-side context; the peers get the whole history again (/v1/chat/completions)
  W4  1-token prompt ("Hello" after BOS), max_tokens 1, 8 clients closed loop: requests/s
  contention  W1 and W2-8 each run again right after, with a busy process pinned to one core:
      contention_keep_frac = busy / idle W1 decode tok/s, w2_8_contention_keep_frac = busy / idle
      W2-8 tok/s, each the median over the rounds of the round's own pair. The two runs of a pair
      are seconds apart, so they meet the same memory speed (which changes from one minute to the
      next here, see below); a ratio of the medians would divide rounds of different speeds. Each
      round's keeps are in `contention_keep_per_round` and `w2_8_contention_keep_per_round`.
      A keep's ratio is against the peer that leads the workload idle (KEEP_OF says why).

Every prompt is new to the server (it starts with its own number), so no prefix cache serves W1,
W2 or a chat's first turn; W3's later turns hit what the previous turn left, as a stateless
client's would. Rounds interleave the systems (each workload: mcpd, vLLM, llama.cpp in turn) and
figures are medians over the rounds; "spread" is (max - min) / median.

The machine's limits are measured in the same run (bench/roofline.py): a streaming read and a
large matrix product. This VM's read rate moves between ~30 and ~64 GB/s from one minute to the
next, so W1's share of it is taken against reads of W1's own moment: one just before and one just
after each system's W1, their mean the limit. A round whose two reads differ by more than 10%
(the memory changed speed during W1) does not count towards the share, unless no round is steady
(`w1_steady_rounds` says how many counted; `w1_share_per_round` lists each round's share, read
and change). The figure is the median over the rounds. The read at the start of each round is
printed for context. The per-token work is counted over the weights every token multiplies by
(all but the embedding table, a one-row lookup: 38.9M of the 55.3M):
  w1_decode_roofline_frac     = W1 decode tok/s * those weights' bytes / read bandwidth
  w2_32_compute_roofline_frac = W2-32 tok/s * 2 FLOPs per such weight / matmul rate
  w2_32_work_compute_frac     = the same with the prompts' tokens counted too: every W2 prompt is
      new, so each generated token comes with a prompt token to prefill (128 of each a request),
      and the first figure cannot pass about half of the matmul rate however fast the engine is

`--http` adds the system "mcpd-http": the same daemon through its OpenAI-compatible listener with
the peers' requests, W3 on a daemon-side context (/v1/contexts/{id}/chat/completions, only each
turn's message sent); with vLLM beside it the JSON gains `http_<figure>_ratio_vs_vllm` for W2-8,
W2-32 and W3 (> 1: mcpd over HTTP leads). `--quick` runs mcpd (and mcpd-http) and the roofline alone, one round (under a minute once the checkpoint is
built). The last line is one JSON object: mcpd's figures at the top level, every system's under
"systems", and, when peers ran, `<figure>_ratio_vs_best_peer`, where > 1 always means mcpd leads:
mcpd / best peer for rates (tok/s, req/s, fractions) and best peer / mcpd for times (ms).

`--isa avx2` on an AVX-512 machine stands in for an AVX2-only one as far as software can: mcpd
runs its AVX2 kernels (engine.kernels = native-avx2), and every process of the run (mcpd, vLLM,
the roofline) is started with torch's, oneDNN's and MKL's instruction sets capped at AVX2
(bench/peerkit/isa.py). llama.cpp runs from its AVX2 build (`--setup` compiles it beside the
-march=native one; without it llama.cpp does not run and `missing_peers` says why).
`cpu_isa`, `mcpd_kernels` and `llamacpp_build` (native or avx2) in the JSON say what ran.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

import roofline
from mcpd.tokenizer import HFTokenizer
from peerkit import checkpoints, isa, servers as peer_servers
from peerkit.clients import HttpTarget, McpdHttpTarget, McpdTarget

W1_PROMPT_TOKENS = 128
W1_MAX_TOKENS = 128
TTFT_SAMPLES = 5
W3_TURNS = 10
W3_TURN_TOKENS = 160
W3_MAX_TOKENS = 16
W4_PROMPT = "Hello"
W4_CLIENTS = 8
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there been one all we their has would when if so no "
         "will more can out some time into two other then what them only new about could these "
         "any like our made first over may after years through where most way well down should").split()
# figure: True when higher is better. The order is the table's.
READ_REPEATS = 10   # best of: each round's read (bench/roofline.py)
W1_READ_REPEATS = 3   # best of: the reads beside W1 (short: they must be of W1's moment)
STEADY_READ_CHANGE = 0.1   # the most the reads before and after W1 may differ for its round to count
OURS = ("mcpd", "mcpd-http")   # mcpd's own systems: never a peer
# A keep (a busy core's rate over the idle rate) is set against the keep of the peer that leads the
# same workload idle, the rival a user would pick for it. The best keep among the peers would
# reward a server for leaving cores unused: one that serves W2-8 at a seventh of mcpd's rate on one
# core loses little to a busy other one.
KEEP_OF = {"contention_keep_frac": "w1_decode_tok_s", "w2_8_contention_keep_frac": "w2_8_tok_s"}
FIGURES = {"w1_decode_tok_s": True, "w1_ttft_ms": False, "w2_8_tok_s": True, "w2_32_tok_s": True,
           "w3_turn10_ttft_ms": False, "w4_req_s": True, "w1_busy_decode_tok_s": True,
           "contention_keep_frac": True, "w2_8_busy_tok_s": True, "w2_8_contention_keep_frac": True,
           "w1_decode_roofline_frac": True, "w2_32_compute_roofline_frac": True,
           "w2_32_work_compute_frac": True}


# -- prompts --------------------------------------------------------------------------------------

class Prompts:
    """Texts of exact token lengths under the checkpoint's tokenizer, each new to the server."""

    def __init__(self, tokenizer: HFTokenizer):
        self.tokenizer = tokenizer
        self.serial = itertools.count()
        self.lock = threading.Lock()

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))   # with BOS, as the servers count

    def text(self, tokens: int, tag: str = "") -> str:
        """A text of `tokens` tokens (BOS included) that starts with its own serial number."""
        with self.lock:
            serial = next(self.serial)
        text = f"{tag}{serial:06d}:"
        for word in itertools.cycle(WORDS):
            longer = f"{text} {word}"
            if self.count(longer) > tokens:
                break
            text = longer
        while self.count(text) < tokens:   # a word of two tokens did not fit: pad one token at a time
            text += "."
        if self.count(text) != tokens:
            raise RuntimeError(f"no text of exactly {tokens} tokens (got {self.count(text)}): {text!r:.80}")
        return text


# -- workloads ------------------------------------------------------------------------------------

def clients_wall_seconds(count: int, work) -> float:
    """Run work() on `count` threads released together; seconds until the last one finished."""
    gate = threading.Barrier(count + 1)
    errors = []

    def client():
        gate.wait()
        try:
            work()
        except Exception as e:   # noqa: BLE001 - re-raised below, in the main thread
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(count)]
    for thread in threads:
        thread.start()
    gate.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def w1(target, prompts: Prompts) -> dict:
    streamed = target.stream(prompts.text(W1_PROMPT_TOKENS), W1_MAX_TOKENS)
    return {"w1_decode_tok_s": streamed.decode_tok_s, "w1_ttft_ms": streamed.first_token_s * 1e3}


def w1_beside_reads(target, prompts: Prompts) -> dict:
    """W1 with the read limit measured just before and just after it (the module's doc says why):
    their mean, and how far apart they are; then W1's first token sampled again."""
    before = roofline.read_gbps(repeats=W1_READ_REPEATS)
    figures = w1(target, prompts)
    after = roofline.read_gbps(repeats=W1_READ_REPEATS)
    return {**figures, **ttft_samples(target, prompts, figures["w1_ttft_ms"]),
            "w1_read_gbps": (before + after) / 2, "w1_read_change": abs(after - before) / max(before, after)}


def ttft_samples(target, prompts: Prompts, w1_ttft_ms: float) -> dict:
    """W1's first token as the median of its own and more one-token streams of new W1 prompts."""
    samples = [w1_ttft_ms] + [target.stream(prompts.text(W1_PROMPT_TOKENS), 1).first_token_s * 1e3
                              for _ in range(TTFT_SAMPLES - 1)]
    return {"w1_ttft_ms": statistics.median(samples)}


def w2(target, prompts: Prompts, clients: int) -> dict:
    texts = [prompts.text(W1_PROMPT_TOKENS) for _ in range(clients)]
    generated = []

    def one():
        generated.append(target.complete(texts.pop(), W1_MAX_TOKENS).completion_tokens)

    seconds = clients_wall_seconds(clients, one)
    return {f"w2_{clients}_tok_s": sum(generated) / seconds}


def w3(target, prompts: Prompts) -> dict:
    turns = [prompts.text(W3_TURN_TOKENS, "Turn ") for _ in range(W3_TURNS)]
    first_s, seen = target.chat_last_turn_ttft(turns, W3_MAX_TOKENS)
    figures = {"w3_turn10_ttft_ms": first_s * 1e3}
    if seen:   # llama-cpp-python does not report usage when streaming
        figures["w3_turn10_prompt_tokens"] = seen
    return figures


def w4(target, seconds: float) -> dict:
    done = []

    def closed_loop():
        count, deadline = 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            target.complete(W4_PROMPT, 1)
            count += 1
        done.append(count)

    wall = clients_wall_seconds(W4_CLIENTS, closed_loop)
    return {"w4_req_s": sum(done) / wall}


def busy_core(work) -> dict:
    """work() while a spinning process holds the last core (a neighbour the server does not own)."""
    busy = peer_servers.spinner(peer_servers.cores()[-1])
    try:
        return work()
    finally:
        peer_servers.stop_spinner(busy)


def w1_then_busy(target, prompts: Prompts) -> dict:
    """W1 beside its reads, then W1 again with one core busy: a pair (the module's doc says why)."""
    idle = w1_beside_reads(target, prompts)
    return {**idle, **busy_core(lambda: {"w1_busy_decode_tok_s": w1(target, prompts)["w1_decode_tok_s"]})}


def w2_8_then_busy(target, prompts: Prompts) -> dict:
    idle = w2(target, prompts, 8)
    return {**idle, **busy_core(lambda: {"w2_8_busy_tok_s": w2(target, prompts, 8)["w2_8_tok_s"]})}


def workloads(quick: bool) -> list:
    return [lambda t, p: w1_then_busy(t, p), lambda t, p: w2_8_then_busy(t, p), lambda t, p: w2(t, p, 32),
            lambda t, p: w3(t, p), lambda t, p: w4(t, 1.5 if quick else 4.0)]


# -- warm-up and checks ---------------------------------------------------------------------------

def warm_up(target, prompts: Prompts) -> dict:
    """Exercise every path once (first calls compile and allocate), and check that the server sees
    the same prompt tokens and honours max_tokens with EOS ignored."""
    check = target.complete(prompts.text(W1_PROMPT_TOKENS, "Warm "), W1_MAX_TOKENS)
    if (check.prompt_tokens, check.completion_tokens) != (W1_PROMPT_TOKENS, W1_MAX_TOKENS):
        raise RuntimeError(f"{target.name} counted {check.prompt_tokens} prompt and {check.completion_tokens} "
                           f"generated tokens, expected {W1_PROMPT_TOKENS} and {W1_MAX_TOKENS}")
    target.stream(prompts.text(W1_PROMPT_TOKENS, "Warm "), 8)
    w2(target, prompts, 4)
    target.chat_last_turn_ttft([prompts.text(W3_TURN_TOKENS, "Warm ") for _ in range(2)], 4)
    target.complete(W4_PROMPT, 1)
    return {"greedy_text": target.complete(GREEDY_PROBE, 24).text}


GREEDY_PROBE = "The quick brown fox jumps over the lazy dog. " * 8


# -- figures --------------------------------------------------------------------------------------

def medians(samples: dict[str, list[float]]) -> tuple[dict, dict]:
    middle = {k: statistics.median(v) for k, v in samples.items()}
    spread = {k: (max(v) - min(v)) / middle[k] if middle[k] else 0.0 for k, v in samples.items()}
    return middle, spread


def derived(figures: dict, samples: dict[str, list[float]], limits: dict) -> dict:
    """The figures that follow from the measured ones (medians; samples: each figure's value in
    each round) and the machine's limits."""
    out = dict(figures)
    for keep, busy, idle in (("contention_keep", "w1_busy_decode_tok_s", "w1_decode_tok_s"),
                             ("w2_8_contention_keep", "w2_8_busy_tok_s", "w2_8_tok_s")):
        pairs = [round(b / i, 3) for b, i in zip(samples[busy], samples[idle])]
        out[f"{keep}_per_round"] = pairs
        out[f"{keep}_frac"] = statistics.median(pairs)
    rounds = list(zip(samples["w1_decode_tok_s"], samples["w1_read_gbps"], samples["w1_read_change"]))
    shares = [round(rate * limits["weight_bytes_per_token"] / (read * 1e9), 3) for rate, read, _ in rounds]
    out["w1_share_per_round"] = [[share, round(read, 1), round(change, 3)] for share, (_, read, change) in zip(shares, rounds)]
    steady = [share for share, (_, _, change) in zip(shares, rounds) if change <= STEADY_READ_CHANGE]
    out["w1_steady_rounds"] = len(steady)
    out["w1_decode_roofline_frac"] = statistics.median(steady or shares)
    out["w2_32_compute_roofline_frac"] = (figures["w2_32_tok_s"] * limits["flops_per_token"]
                                          / (limits["matmul_gflops"] * 1e9))
    out["w2_32_work_compute_frac"] = (out["w2_32_compute_roofline_frac"]
                                      * (W1_PROMPT_TOKENS + W1_MAX_TOKENS) / W1_MAX_TOKENS)
    return out


def ratios_vs_best_peer(systems: dict[str, dict]) -> dict:
    """`<figure>_ratio_vs_best_peer`: > 1 means mcpd leads. Rates: mcpd / the best peer's;
    times: the best peer's / mcpd's. Also which peer was best at each."""
    peers = {name: figures for name, figures in systems.items() if name not in OURS}
    out, best_peer = {}, {}
    if not peers:
        return out
    for figure, higher_is_better in FIGURES.items():
        ranked_by = KEEP_OF.get(figure, figure)
        pick = max if FIGURES[ranked_by] else min
        best = pick(peers, key=lambda name: peers[name][ranked_by])
        ours, theirs = systems["mcpd"][figure], peers[best][figure]
        out[f"{figure}_ratio_vs_best_peer"] = ours / theirs if higher_is_better else theirs / ours
        best_peer[figure] = best
    out["best_peer"] = best_peer
    return out


def http_ratios_vs_vllm(systems: dict[str, dict]) -> dict:
    """Issue 17: mcpd over HTTP against vLLM's OpenAI server on W2 and W3 (> 1: mcpd-http leads),
    `http_<figure>_ratio_vs_vllm`, when both ran."""
    if "mcpd-http" not in systems or "vllm" not in systems:
        return {}
    ours, theirs = systems["mcpd-http"], systems["vllm"]
    return {f"http_{figure}_ratio_vs_vllm": round(ours[figure] / theirs[figure] if FIGURES[figure]
                                                  else theirs[figure] / ours[figure], 3)
            for figure in ("w2_8_tok_s", "w2_32_tok_s", "w3_turn10_ttft_ms")}


def table(systems: dict[str, dict], spreads: dict[str, dict], ratios: dict) -> str:
    names = list(systems)
    header = ["figure", *names] + (["mcpd / best peer"] if ratios else [])
    rows = []
    for figure in FIGURES:
        cells = [figure]
        for name in names:
            spread = spreads[name].get(figure)
            cells.append(f"{systems[name][figure]:.3g}" + (f" ±{spread / 2:.0%}" if spread is not None else ""))
        if ratios:
            cells.append(f"{ratios[f'{figure}_ratio_vs_best_peer']:.2f} ({ratios['best_peer'][figure]})")
        rows.append(cells)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in [header, *rows])


# -- the run --------------------------------------------------------------------------------------

def start_systems(args, checkpoint_dir: Path) -> tuple[dict, dict, dict]:
    """mcpd and every installed peer, started one after the other (vLLM compiles for minutes at
    start: nothing else may run meanwhile). Returns servers, targets, and why peers are missing."""
    servers, targets, missing = {}, {}, {}
    for peer in ([] if args.quick else args.peers):
        install = peer_servers.installed_as(peer, args.isa)
        reason = peer_servers.missing_reason(args.cache_dir, install, checkpoint_dir, args.dtype)
        if reason is None:
            print(f"starting {install} ...", flush=True)
            try:
                servers[peer] = peer_servers.PEER_SERVERS[install](args.cache_dir, checkpoint_dir, args.dtype).start()
                targets[peer] = HttpTarget(peer, servers[peer].port)
                continue
            except RuntimeError as e:
                reason = f"did not start: {e}"
        missing[peer] = reason
        print(f"{peer}: missing: {reason}", flush=True)
    servers["mcpd"] = peer_servers.McpdServer(checkpoint_dir, args.dtype, isa.mcpd_kernels(args.isa)).start()
    ours = {"mcpd": McpdTarget(servers["mcpd"].endpoint)}
    if args.http:
        ours["mcpd-http"] = McpdHttpTarget(servers["mcpd"].http_port)
    targets = {**ours, **targets}
    return servers, targets, missing


def machine_limits(dtype: torch.dtype, quick: bool) -> dict:
    torch.set_num_threads(len(peer_servers.cores()))
    shape = checkpoints.ISSUE_SHAPE
    return {"matmul_gflops": roofline.matmul_gflops(dtype, repeats=5 if quick else 10),
            "weight_bytes_per_token": shape.matmul_parameters * dtype.itemsize,
            "flops_per_token": 2 * shape.matmul_parameters}


def measure(targets: dict, pids: list[int], prompts: Prompts, rounds: int, quick: bool) -> tuple[dict, list, list]:
    """Each figure's samples per system, the load average at the end of each round and the read
    rate (GB/s) at the start of each, all servers settled."""
    samples, loads, reads = {name: {} for name in targets}, [], []
    for round_number in range(1, rounds + 1):
        started = time.monotonic()
        peer_servers.settle(pids)
        reads.append(roofline.read_gbps(repeats=READ_REPEATS))
        for workload in workloads(quick):
            for name, target in targets.items():
                peer_servers.settle(pids)
                for figure, value in workload(target, prompts).items():
                    samples[name].setdefault(figure, []).append(value)
        loads.append(round(os.getloadavg()[0], 2))
        print(f"round {round_number}/{rounds}: {time.monotonic() - started:.0f} s, load average {loads[-1]}",
              flush=True)
    return samples, loads, reads


@dataclass
class Run:
    systems: dict       # system -> figure -> median (derived figures included)
    spreads: dict       # system -> figure -> (max - min) / median
    limits: dict        # the roofline and the per-token work it is judged with
    checks: dict        # system -> what its warm-up returned
    idle: dict          # system -> CPU % of its process tree while idle
    missing: dict       # peer -> why it did not run
    loads: list         # 1-minute load average at the start and after each round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="install the peers and build their inputs, then exit")
    parser.add_argument("--quick", action="store_true", help="mcpd and the roofline only, one round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--peers", default=",".join(peer_servers.PEERS), help="comma-separated subset to run")
    parser.add_argument("--http", action="store_true", help="also mcpd over its OpenAI-compatible HTTP listener "
                                                           "(system mcpd-http; W3 on a context)")
    parser.add_argument("--cache-dir", type=Path, default=checkpoints.DEFAULT_CACHE)
    parser.add_argument("--isa", choices=isa.CHOICES, default="native",
                        help="avx2: mcpd on its AVX2 kernels and every library capped at AVX2 (see above)")
    args = parser.parse_args()
    isa.cap(args.isa)
    args.peers = peer_servers.chosen(parser, args.peers, peer_servers.PEERS)
    if args.setup:
        peer_servers.setup(args.cache_dir)
        return
    checkpoint_dir, vocab = checkpoints.checkpoint(args.cache_dir, getattr(torch, args.dtype))
    print(f"checkpoint {checkpoint_dir}: {vocab}", flush=True)
    report(args, run(args, checkpoint_dir), vocab)


def run(args, checkpoint_dir: Path) -> Run:
    rounds = 1 if args.quick else args.rounds
    loads = [round(os.getloadavg()[0], 2)]
    prompts = Prompts(HFTokenizer(checkpoint_dir, set()))
    servers, targets, missing = start_systems(args, checkpoint_dir)
    try:
        checks = {name: warm_up(target, prompts) for name, target in targets.items()}
        pids = [server.pid() for server in servers.values()]
        peer_servers.settle(pids)
        idle = {name: round(peer_servers.cpu_percent([server.pid()], 1.0), 1) for name, server in servers.items()}
        limits = machine_limits(getattr(torch, args.dtype), args.quick)
        samples, round_loads, limits["read_gbps_per_round"] = measure(targets, pids, prompts, rounds, args.quick)
        limits["read_gbps"] = statistics.median(limits["read_gbps_per_round"])
    finally:
        for server in servers.values():
            server.stop()
    systems, spreads = {}, {}
    for name, figures in samples.items():
        middle, spreads[name] = medians(figures)
        systems[name] = derived(middle, figures, limits)
    return Run(systems, spreads, limits, checks, idle, missing, loads + round_loads)


def rounded(values: dict, digits: int) -> dict:
    """Its numbers rounded for the JSON line; the rest (lists, names) as they are."""
    return {k: round(v, digits) if isinstance(v, (int, float)) else v for k, v in values.items()}


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "?")
    return f"{model}, {len(peer_servers.cores())} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"


def report(args, result: Run, vocab: str) -> None:
    systems = result.systems
    ratios = ratios_vs_best_peer(systems)
    rounds = len(result.loads) - 1
    built = f"; llama.cpp's {args.isa} build" if "llama.cpp" in systems else ""
    print(f"\nmedians of {rounds} round(s), {args.dtype}{built}; ± is half the spread (max - min) / median")
    print(table(systems, result.spreads, ratios))
    limits = result.limits
    rounds_read = ", ".join(f"{read:.1f}" for read in limits["read_gbps_per_round"])
    print(f"roofline: read {limits['read_gbps']:.1f} GB/s (median; rounds: {rounds_read}), "
          f"matmul {limits['matmul_gflops']:.0f} GFLOP/s "
          f"({args.dtype}); idle CPU % of each server: {result.idle}; load average {result.loads}")
    same_text = {name: check["greedy_text"] == result.checks["mcpd"]["greedy_text"]
                 for name, check in result.checks.items()}
    print(f"greedy text identical to mcpd's on a probe: {same_text}")
    for peer, reason in result.missing.items():
        print(f"{peer} did not run: {reason}")
    versions = {peer: peer_servers.version(args.cache_dir, peer_servers.installed_as(peer, args.isa))
                for peer in systems if peer not in OURS}
    print(json.dumps({
        **rounded(systems["mcpd"], 4),
        **rounded(ratios, 3),
        **http_ratios_vs_vllm(systems),
        "systems": {name: rounded(figures, 4) for name, figures in systems.items()},
        "spread": {name: {k: round(v, 3) for k, v in s.items()} for name, s in result.spreads.items()},
        "roofline": {"read_gbps": round(limits["read_gbps"], 1),
                     "read_gbps_per_round": [round(read, 1) for read in limits["read_gbps_per_round"]],
                     "matmul_gflops": round(limits["matmul_gflops"], 1),
                     "weight_bytes_per_token": limits["weight_bytes_per_token"],
                     "flops_per_token": limits["flops_per_token"]},
        "greedy_text_same_as_mcpd": same_text, "idle_cpu_percent": result.idle, "missing_peers": result.missing,
        "versions": versions, "machine": machine(), "cpu_isa": isa.described(args.isa), "mcpd_kernels": isa.mcpd_kernels(args.isa),
        **({"llamacpp_build": args.isa} if "llama.cpp" in systems else {}),
        "vocab": vocab, "dtype": args.dtype, "rounds": rounds,
        "quick": args.quick, "load_avg": result.loads}))


if __name__ == "__main__":
    main()

"""The current figures: run benchmarks, keep each one's last JSON line with the run's machine, and
write bench/README.md's table from what is kept.

    python bench/figures.py run [--quick] NAME ... | all [-- FLAG ...]   # run, keep, rewrite the table
    python bench/figures.py table                                       # rewrite the table from what is kept

Flags after `--` go to each benchmark named, as its own (`run gguf_quantized -- --isa avx2`).
A run keeps bench/figures/NAME.json (NAME@avx2.json for a run on the AVX2 kernels, so that each
instruction set's figures stand side by side): the benchmark's JSON line and when, with which flags, on
which commit and which machine it ran (CPU model, cores, memory, ISA: AVX-512 with or without
bf16, AVX2, or neither; the GPU if any; the load average at its start). A benchmark that fails or prints no JSON line
keeps what it had, and the command exits 1. The table shows each benchmark's figures that have a
target (TARGETS) with their target and whether the run met it; a figure a benchmark did not print
shows as "—". The history of the figures is git's: each run rewrites its file.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
KEPT = BENCH / "figures"
README = BENCH / "README.md"
BEGIN, END = "<!-- figures: begin (bench/figures.py table) -->", "<!-- figures: end -->"
RUN_LIMIT_S = 3600

GGUF_QUANTS = ("q4_1", "q4_k_m", "q8_0")
# (benchmark, figure, comparison, target): the figure meets the target when `comparison` holds; a
# dotted figure is a path into nested maps of the JSON line.
TARGETS = [
    ("engine", "w1_decode_roofline_frac", ">=", 0.8),
    ("engine", "w1_ttft_ms", "<=", 30),
    ("engine", "prefill_compute_roofline_frac", ">=", 0.6),
    ("engine", "contention_keep_frac", ">=", 0.7),
    ("overhead", "noop_p50_ratio_vs_relay", "<=", 1.3),
    ("overhead", "one_token_server_ms", "<=", 1.5),
    ("overhead", "curve_p50_ratio_vs_plain", "<=", 1.3),
    ("overhead", "tracing_p50_overhead", "<=", 1.1),
    ("overhead", "tracing_ratio0_overhead", "<=", 1.05),
    ("overhead", "tracing_turn_spans_frac", ">=", 0.9),
    ("batching", "decode_throughput_ratio_32_vs_1", ">=", 8),
    ("kv", "kv_waste_frac", "<=", 0.04),
    ("kv", "buddy_internal_waste_frac", "<=", 0.08),
    ("kv", "pool_internal_waste_frac", "<=", 0.02),
    ("kv", "pool_external_fragmentation", "<=", 0.2),
    ("contexts", "ttft_speedup_vs_recompute", ">=", 10),
    ("contexts", "delta_payload_frac", "<=", 0.03),
    ("contexts", "delta_sync_speedup", ">=", 10),
    ("priority", "high_p99_ratio_overload_vs_idle", "<=", 2),
    ("priority", "unanswered", "==", 0),
    ("delta_codec", "delta_payload_frac", "<=", 0.03),
    ("recovery", "unanswered", "==", 0),
    ("recovery", "recomputed_tokens_after_kill", "==", 0),
    ("redteam", "broken", "==", 0),
    ("redteam", "lost", "==", 0),
    ("redteam", "attacks.noisy_neighbour.noisy_neighbour", "<=", 2),
    ("http_listener", "http_p50_ratio_vs_zmq", "<=", 1.3),
    ("http_listener", "context_bytes_ratio_vs_resend", ">=", 5),
    ("persistence", "persist_overhead_frac", "<=", 0.2),
    ("versions", "failed_during_switch", "==", 0),
    ("versions", "shadow_p50_overhead_frac", "<=", 0.05),
    ("versions", "split_max_deviation", "<=", 0.01),
    ("quantized", "int8_decode_speedup", ">=", 2.5),
    ("restart", "restart_ratio_vs_recompute", "<=", 0.5),
    ("gpu_decode", "w1_hbm_roofline_frac", ">=", 0.78),
    ("gpu_decode", "w1_first_token_ms", "<=", 2),
    ("cluster", "ownership_balance", "<=", 1.05),
    ("cluster", "moved_frac_times_n", "<=", 1.1),
    ("cluster", "redis_commit_overhead", "<=", 1.5),
    ("cluster", "forward_p50_ratio", "<=", 1.3),
    ("cluster", "lost_acked_updates", "==", 0),
    ("cluster", "unanswered", "==", 0),
    ("cluster", "wrong_version_answers", "==", 0),
    ("cluster", "failover_first_token_s_max", "<=", 2),
    *(("peers", f"{figure}_ratio_vs_best_peer", ">=", 1)
      for figure in ("w1_decode_tok_s", "w1_ttft_ms", "w2_8_tok_s", "w2_32_tok_s", "w3_turn10_ttft_ms", "w4_req_s",
                     "w1_busy_decode_tok_s", "contention_keep_frac", "w2_8_busy_tok_s", "w2_8_contention_keep_frac")),
    ("peers", "w1_decode_roofline_frac", ">=", 0.8),
    ("peers", "w2_32_work_compute_frac", ">=", 0.6),
    *(("gguf_quantized", f"gguf_{quant}_{figure}_ratio_vs_llamacpp", ">=", 1) for quant in GGUF_QUANTS
      for figure in ("w1_decode_tok_s", "w1_ttft_ms", "w2_8_tok_s", "w2_32_tok_s", "w3_turn10_ttft_ms", "w4_req_s")),
    *(("gguf_quantized", f"w1_read_frac_{quant}", ">=", 0.8) for quant in GGUF_QUANTS),
    ("gguf_quantized", "tokenizer_exact", "==", True),
    ("gguf_quantized", "q4_top1_agreement", ">=", 0.99),
    ("gguf_quantized", "resident_weight_ratio", "<=", 1.1),
    ("gguf_quantized", "gguf_q4_k_m_resident_weight_ratio", "<=", 1.1),
    ("handlers", "handler_risk_rps_ratio_vs_best_peer", ">=", 1.5),
    ("handlers", "handler_text_rps_ratio_vs_best_peer", ">=", 1.5),
    ("handlers", "batching_speedup", ">=", 5),
    ("handlers", "batching_ceiling_frac", ">=", 0.9),
    ("handlers", "handler_high_p99_ratio", "<=", 2),
    ("handlers", "handler_unanswered", "==", 0),
    ("handlers", "cache_hit_rate", ">=", 0.9),
    ("handlers", "cache_rps_ratio", ">=", 3),
    ("handlers", "context_bytes_ratio", ">=", 10),
]
COMPARE = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t, "==": lambda v, t: v == t}
SYMBOL = {"<=": "≤", ">=": "≥", "==": "="}


def benchmarks() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "figures")


def isa(flags: set[str]) -> str:
    if "avx512f" in flags:
        bf16 = " + bf16" if "avx512_bf16" in flags else ""
        return "AVX-512" + bf16 + (" + AMX" if "amx_bf16" in flags else "")   # AMX: kernels.c's native-amx set
    return "AVX2" if "avx2" in flags else "no AVX2"


def machine() -> dict:
    """What the figures depend on: the CPU and its ISA, cores, memory, a GPU, the load."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    field = lambda name: next((l.split(":", 1)[1].strip() for l in cpuinfo.splitlines() if l.startswith(name)), "")
    memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    gpu = subprocess.run(["sh", "-c", "nvidia-smi -L 2>/dev/null | head -1"], capture_output=True, text=True).stdout
    return {"cpu": field("model name"), "isa": isa(set(field("flags").split())), "cores": os.cpu_count(),
            "memory_gib": round(memory_kib / 2**20), "gpu": gpu.strip() or None,
            "load_average": round(os.getloadavg()[0], 2)}


def commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=BENCH, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--", "mcpd") else "")


def last_json_line(output: str) -> dict | None:
    for line in reversed(output.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        return found if isinstance(found, dict) else None
    return None


def run(name: str, quick: bool, flags: list[str]) -> bool:
    """Run bench/NAME.py with flags, its output passed through; keep its JSON line. False if it gave none."""
    command = [sys.executable, str(BENCH / f"{name}.py")] + (["--quick"] if quick else []) + flags
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
              "machine": machine(), "quick": quick, "flags": flags}
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    returncode, output = passed_through(command)
    figures = last_json_line(output)
    if returncode != 0 or figures is None:
        print(f"== {name}: exit {returncode}, {'a' if figures else 'no'} JSON line: nothing kept", flush=True)
        return False
    KEPT.mkdir(exist_ok=True)
    (KEPT / f"{kept_name(name, flags)}.json").write_text(json.dumps({**record, "figures": figures}, indent=1) + "\n")
    return True


def kept_name(name: str, flags: list[str]) -> str:
    """NAME, or NAME@avx2 for a run on the AVX2 kernels (`--isa avx2`, `--kernels native-avx2`):
    each instruction set's figures are kept side by side."""
    words = [part for flag in flags for part in flag.split("=", 1)]
    pairs = set(zip(words, words[1:]))
    return f"{name}@avx2" if {("--isa", "avx2"), ("--kernels", "native-avx2")} & pairs else name


def passed_through(command: list[str]) -> tuple[int, str]:
    """Run `command`, its output shown line by line as it comes (long benchmarks print progress),
    and kept; killed past RUN_LIMIT_S."""
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        timer = threading.Timer(RUN_LIMIT_S, process.kill)
        timer.start()
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
        timer.cancel()
    return process.returncode, "".join(lines)


def kept() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(KEPT.glob("*.json"))}


def figure_of(figures: dict, path: str):
    for key in path.split("."):
        figures = figures.get(key) if isinstance(figures, dict) else None
    return figures


def shown(value) -> str:
    if value is None:
        return "—"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(records: dict[str, dict]) -> str:
    rows = ["| benchmark | figure | value | target | met |", "|---|---|---|---|---|"]
    for name, figure, comparison, target in TARGETS:
        for key in variants(name, records):
            value = figure_of(records.get(key, {}).get("figures", {}), figure)
            met = "—" if not isinstance(value, (int, float)) else "yes" if COMPARE[comparison](value, target) else "**no**"
            rows.append(f"| `{key}` | `{figure}` | {shown(value)} | {SYMBOL[comparison]} {target} | {met} |")
    runs = ["| benchmark | when | commit | machine | ISA | load | flags |", "|---|---|---|---|---|---|---|"]
    for name in [key for bench in benchmarks() for key in variants(bench, records)]:
        record = records.get(name)
        if record is None:
            runs.append(f"| `{name}` | not run since figures were kept | | | | | |")
            continue
        m = record["machine"]
        where = f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB" + (f", {m['gpu']}" if m["gpu"] else "")
        isa_run = m["isa"] + (", AVX2 kernels" if name.endswith("@avx2") else "")
        runs.append(f"| `{name}` | {record['date']} | {record['commit']} | {where} | {isa_run} | "
                    f"{m['load_average']} | {flags_shown(record)} |")
    return "\n".join(rows + ["", "The runs behind them:", ""] + runs)


def variants(name: str, records: dict[str, dict]) -> list[str]:
    """The kept names of a benchmark's runs: its own, and NAME@avx2 where one is kept."""
    return [name] + ([f"{name}@avx2"] if f"{name}@avx2" in records else [])


def flags_shown(record: dict) -> str:
    """The flags the benchmark ran with; "full" for none (not --quick)."""
    return " ".join((["--quick"] if record["quick"] else []) + record.get("flags", [])) or "full"


def write_table() -> None:
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    README.write_text(f"{head}{BEGIN}\n{table(kept())}\n{END}{tail}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """figures.py's own arguments, and in `flags` what follows `--`: the benchmarks'."""
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run", help="run benchmarks, keep their figures, rewrite the table")
    runner.add_argument("--quick", action="store_true")
    runner.add_argument("names", nargs="+", choices=benchmarks() + ["all"])
    sub.add_parser("table", help="rewrite bench/README.md's table from the kept figures")
    args = parser.parse_args(ours)
    if flags and args.command != "run":
        parser.error("flags after -- are for `run`")
    args.flags = flags
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    failed = []
    if args.command == "run":
        names = benchmarks() if "all" in args.names else args.names
        failed = [name for name in names if not run(name, args.quick, args.flags)]
    write_table()
    if failed:
        sys.exit(f"no figures from: {', '.join(failed)}")


if __name__ == "__main__":
    main()

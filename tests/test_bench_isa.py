"""bench/peerkit/isa.py: `--isa avx2` runs the benchmark again with torch capped at AVX2 before it
loads (an AVX-512 machine standing in for an AVX2-only one), its own arguments kept; llama.cpp
then runs from its AVX2 build (bench/peerkit/llamacpp_avx2.py), refused where that is missing,
and the set-up's check of that build tells an AVX-512 one apart."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcpd.cpu import features

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from peerkit import isa, llamacpp_avx2, servers  # noqa: E402
SCRIPT = f"""import json, sys
sys.path.insert(0, {str(BENCH)!r})
from peerkit import isa
isa.cap(sys.argv[1])
import torch
print(json.dumps({{"capability": torch.backends.cpu.get_cpu_capability(), "argv": sys.argv[1:]}}))
"""


def run_capped(tmp_path: Path, choice: str) -> dict:
    script = tmp_path / "bench_like.py"
    script.write_text(SCRIPT)
    environment = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                                    "MKL_ENABLE_INSTRUCTIONS")}
    done = subprocess.run([sys.executable, str(script), choice, "--quick"], capture_output=True, text=True,
                          env=environment, timeout=120, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not features.has("avx512f"), reason="nothing to mask on a CPU without AVX-512")
def test_avx2_restarts_the_script_with_torch_capped_and_its_arguments_kept(tmp_path):
    assert run_capped(tmp_path, "avx2") == {"capability": "AVX2", "argv": ["avx2", "--quick"]}
    assert run_capped(tmp_path, "native")["capability"] == "AVX512"


def test_avx2_serves_llamacpp_from_its_avx2_build_and_native_from_the_native_one(tmp_path):
    assert servers.installed_as("llama.cpp", "avx2") == "llama.cpp-avx2"
    assert servers.installed_as("llama.cpp", "native") == "llama.cpp"
    assert servers.installed_as("vllm", "avx2") == "vllm"
    serving = servers.llama_cpp_serving(tmp_path, tmp_path / "m.gguf", install=servers.installed_as("llama.cpp", "avx2"))
    assert serving.command[0] == str(tmp_path / "venvs" / "llamacpp-avx2" / "bin" / "python")
    assert servers.llama_cpp_serving(tmp_path, tmp_path / "m.gguf").command[0] == str(
        tmp_path / "venvs" / "llamacpp" / "bin" / "python")


def test_a_missing_avx2_build_is_refused_with_the_setup_never_the_native_one_in_its_place(tmp_path):
    native = servers.venv_dir(tmp_path, "llama.cpp")
    native.mkdir(parents=True)
    (native / ".bench-installed").write_text("llama-cpp-python")
    assert servers.not_installed(tmp_path, "llama.cpp") is None
    reason = servers.missing_reason(tmp_path, servers.installed_as("llama.cpp", "avx2"), tmp_path, "float32")
    assert reason == f"not installed (bench/peers.py --setup installs it into {tmp_path / 'venvs' / 'llamacpp-avx2'})"


def test_the_setup_builds_the_avx2_llamacpp_without_avx512_options():
    environment, options, check = servers.SOURCE_BUILDS["llama.cpp-avx2"]
    flags = environment["CMAKE_ARGS"].split()
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF",
            "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_INT8=OFF"} <= set(flags)
    assert not [flag for flag in flags if flag.endswith("=ON") and ("512" in flag or "AMX" in flag or "VNNI" in flag)]
    assert environment["FORCE_CMAKE"] == "1" and "--no-binary" in options and "--no-cache-dir" in options
    assert check is llamacpp_avx2.verify


NATIVE_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
               "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | ")
AVX2_INFO = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "


def test_the_system_info_check_names_every_feature_past_avx2():
    assert llamacpp_avx2.system_info_flaws(AVX2_INFO) == []
    assert llamacpp_avx2.system_info_flaws(NATIVE_INFO) == [
        "AVX_VNNI = 1", "AVX512 = 1", "AVX512_VBMI = 1", "AVX512_VNNI = 1", "AVX512_BF16 = 1", "AMX_INT8 = 1"]
    assert llamacpp_avx2.system_info_flaws(AVX2_INFO.replace("AVX2 = 1", "AVX2 = 0")) == ["AVX2 is not on"]


def test_the_disassembly_check_counts_avx512_registers_only():
    avx2 = ("  4010:\tc5 fd 58 c1          \tvaddpd %ymm1,%ymm0,%ymm0\n"
            "  4014:\tc4 62 7d 18 7e 0c    \tvbroadcastss 0xc(%rsi),%ymm15\n")
    avx512 = ("  4020:\t62 f1 fd 48 58 c1    \tvaddpd %zmm1,%zmm0,%zmm0\n"
              "  4026:\t62 e1 7c 28 10 07    \tvmovups (%rdi),%ymm16\n"
              "  402c:\tc5 f8 93 c1          \tkmovw %k1,%eax\n")
    assert llamacpp_avx2.avx512_instructions(avx2) == 0
    assert llamacpp_avx2.avx512_instructions(avx2 + avx512) == 3


@pytest.mark.skipif(not features.has("avx512f"), reason="nothing masked on a CPU without AVX-512")
def test_avx2_describes_llamacpp_as_built_without_avx512():
    assert isa.described("avx2") == "AVX2 (AVX-512 masked for mcpd, torch, oneDNN and MKL; llama.cpp built without it)"

"""llama.cpp as an AVX2-only CPU runs it, for `--isa avx2` (bench/peerkit/isa.py): the same
llama-cpp-python compiled without -march=native, AVX2/FMA/F16C/BMI2 on and every AVX-512, AVX-VNNI
and AMX option off (the option names of the sdist's vendor/llama.cpp/ggml/CMakeLists.txt). The set-up
checks the built libraries: a build that still holds AVX-512 code would make the run a lie.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

CMAKE_ARGS = " ".join(
    [f"-DGGML_{name}=ON" for name in ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C")]
    + [f"-DGGML_{name}=OFF" for name in ("NATIVE", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                                         "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16")])
# FORCE_CMAKE and --no-binary make pip compile; --no-cache-dir keeps it from reusing the native wheel.
BUILD_ENV = {"CMAKE_ARGS": CMAKE_ARGS, "FORCE_CMAKE": "1"}
PIP_OPTIONS = ["--no-binary", "llama-cpp-python", "--no-cache-dir"]

# Registers only AVX-512 code names (AT&T syntax): zmm, the mask registers, and xmm/ymm 16-31.
AVX512_REGISTER = re.compile(r"%(zmm\d+|k[0-7]\b|[xy]mm(1[6-9]|2\d|3[01])\b)")
# system_info's features an AVX2-only CPU lacks.
NOT_AVX2 = ("AVX512", "AVX_VNNI", "AMX")
SYSTEM_INFO = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"


def avx512_instructions(disassembly: str) -> int:
    """How many instructions of objdump -d's text name an AVX-512 register."""
    return sum(1 for line in disassembly.splitlines() if AVX512_REGISTER.search(line))


def system_info_flaws(system_info: str) -> list[str]:
    """What llama.cpp's system_info line says against an AVX2-only build: a feature past AVX2 on,
    or AVX2 itself off."""
    parts = (part.rsplit("=", 1) for part in system_info.replace(":", "|").split("|") if "=" in part)
    features = {name.strip(): value.strip() for name, value in parts}
    flaws = [f"{name} = 1" for name, value in features.items() if value == "1" and name.startswith(NOT_AVX2)]
    return flaws + ([] if features.get("AVX2") == "1" else ["AVX2 is not on"])


def verify(venv: Path) -> None:
    """RuntimeError unless the venv's llama.cpp libraries hold no AVX-512 instruction and its
    system_info reports AVX2 and nothing past it."""
    libraries = sorted(venv.glob("lib/python*/site-packages/llama_cpp/lib/lib*.so"))
    if not libraries:
        raise RuntimeError(f"no llama.cpp libraries under {venv}")
    for library in libraries:
        if count := avx512_instructions(output(["objdump", "-d", str(library)])):
            raise RuntimeError(f"{library.name} holds {count} AVX-512 instructions: not an AVX2-only build "
                               f"(remove {venv} and run --setup again)")
    system_info = output([str(venv / "bin/python"), "-c", SYSTEM_INFO]).strip()
    if flaws := system_info_flaws(system_info):
        raise RuntimeError(f"llama.cpp's system_info says {', '.join(flaws)}: not an AVX2-only build ({system_info}; "
                           f"remove {venv} and run --setup again)")


def output(command: list[str]) -> str:
    """command's stdout; RuntimeError (what the set-up reports) when it cannot run or fails."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"{command[0]} failed: {e}") from e

"""bench/peerkit/isa.py: `--isa avx2` runs the benchmark again with torch capped at AVX2 before it
loads (an AVX-512 machine standing in for an AVX2-only one), its own arguments kept."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcpd.cpu import features

BENCH = Path(__file__).resolve().parent.parent / "bench"
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

"""bench/gguf_quantized.py's options reach what runs: --isa avx2 picks the AVX2 kernels, and the
daemon it sets beside llama.cpp runs the kernels asked for (a real daemon on a tiny GGUF)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gguf_quantized  # noqa: E402
from peerkit import servers  # noqa: E402
from tiny_gguf import write_gguf  # noqa: E402


def test_isa_avx2_picks_the_avx2_kernels_unless_kernels_are_named():
    assert gguf_quantized.parse_args(["--isa", "avx2"]).kernels == "native-avx2"
    assert gguf_quantized.parse_args([]).kernels == "auto"
    assert gguf_quantized.parse_args(["--isa", "avx2", "--kernels", "torch"]).kernels == "torch"


def test_the_daemon_beside_llamacpp_runs_the_kernels_asked_for(tmp_path):
    systems = gguf_quantized.systems(write_gguf(tmp_path, "llama", "Q4_0"), False, "native-avx2", "llama.cpp-avx2")
    assert servers.PLAIN_BUFFERS in systems["llama.cpp"].command
    assert systems["llama.cpp"].command[0] == str(servers.venv_dir(gguf_quantized.DEFAULT_CACHE, "llama.cpp-avx2")
                                                  / "bin" / "python")
    mcpd = systems["mcpd"].start()
    try:
        [device] = mcpd.daemon.status()["devices"]
        assert device["kernels"] == "native-avx2"
    finally:
        mcpd.stop()

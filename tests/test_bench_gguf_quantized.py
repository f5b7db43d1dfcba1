"""bench/gguf_quantized.py's options reach what runs: --isa avx2 picks the AVX2 kernels, and the
daemon it sets beside llama.cpp runs the kernels asked for (a real daemon on a tiny GGUF)."""
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gguf_quantized  # noqa: E402
from peerkit import servers  # noqa: E402
from tiny_gguf import write_gguf  # noqa: E402
from tiny_checkpoints import VOCAB_SIZE  # noqa: E402


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


def test_w1_and_w4_take_three_samples_a_system_in_quick_and_full_runs_alike():
    import peers
    for rounds in (1, 3):
        plan = gguf_quantized.sampled_workloads(rounds, quick=rounds == 1)
        assert [times * rounds for _, times in plan] == [3, rounds, rounds, rounds, 3]
        assert plan[0][0] is peers.w1_beside_reads


def test_the_spread_is_each_repeated_figures_range_over_its_median():
    samples = {"mcpd": {"w1_decode_tok_s": [100.0, 150.0, 120.0], "w4_req_s": [300.0], "w2_8_tok_s": [500.0]},
               "llama.cpp": {"w1_decode_tok_s": [80.0, 80.0, 80.0], "w4_req_s": [330.0, 300.0, 360.0],
                             "w2_8_tok_s": [90.0]}}
    assert gguf_quantized.spreads(samples) == {"mcpd": {"w1_decode_tok_s": 50.0 / 120.0},
                                               "llama.cpp": {"w1_decode_tok_s": 0.0, "w4_req_s": 60.0 / 330.0}}


def test_the_read_fraction_divides_each_w1_sample_by_the_read_limit_of_its_own_moment():
    """A sample taken while the machine read at half its pace counts as one at full pace."""
    samples = {"w1_decode_tok_s": [100.0, 50.0, 90.0], "w1_read_gbps": [10.0, 5.0, 10.0]}
    assert gguf_quantized.read_fraction(samples, 10 ** 8) == 1.0


def test_a_token_reads_its_embedding_row_and_the_embedding_whole_only_as_a_tied_head(tmp_path):
    for kind, tied in (("llama", False), ("qwen2", True)):
        path = write_gguf(tmp_path / kind, kind, "Q8_0")
        tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
        assert ("output.weight" not in tensors) == tied
        embedding, row = tensors["token_embd.weight"], tensors["token_embd.weight"] // VOCAB_SIZE
        whole = sum(tensors.values())
        assert gguf_quantized.token_read_bytes(path) == (whole + row if tied else whole - embedding + row)

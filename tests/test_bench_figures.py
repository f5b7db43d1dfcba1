"""bench/README.md's table is written from the kept JSON lines alone (bench/figures.py), so a
figure in it always names the run, commit and machine it came from."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_figures():
    spec = importlib.util.spec_from_file_location("bench_figures", BENCH / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = load_figures()


def record(values: dict, isa: str = "AVX2") -> dict:
    machine = {"cpu": "EPYC", "isa": isa, "cores": 2, "memory_gib": 24, "gpu": None, "load_average": 0.1}
    return {"date": "2026-11-28 17:00 UTC", "commit": "abc1234", "machine": machine, "quick": True,
            "figures": values}


def row_of(text: str, bench: str, figure: str) -> list[str]:
    line = next(l for l in text.splitlines() if l.startswith(f"| `{bench}` | `{figure}` |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_readme_table_is_the_one_the_kept_figures_give():
    text = (BENCH / "README.md").read_text()
    inside = text.split(figures.BEGIN, 1)[1].split(figures.END, 1)[0]
    assert inside.strip() == figures.table(figures.kept()).strip()


def test_a_figure_is_judged_against_its_target():
    text = figures.table({"overhead": record({"one_token_server_ms": 0.9, "curve_p50_ratio_vs_plain": 1.4}),
                          "redteam": record({"broken": 0, "lost": 2})})
    assert row_of(text, "overhead", "one_token_server_ms")[2:] == ["0.9", "≤ 1.5", "yes"]
    assert row_of(text, "overhead", "curve_p50_ratio_vs_plain")[2:] == ["1.4", "≤ 1.3", "**no**"]
    assert row_of(text, "redteam", "lost")[2:] == ["2", "= 0", "**no**"]
    assert row_of(text, "overhead", "noop_p50_ratio_vs_relay")[2:] == ["—", "≤ 1.3", "—"]


def test_a_dotted_figure_is_read_from_nested_maps():
    nested = record({"broken": 0, "attacks": {"noisy_neighbour": {"noisy_neighbour": 1.5}}})
    text = figures.table({"redteam": nested})
    assert row_of(text, "redteam", "attacks.noisy_neighbour.noisy_neighbour")[2:] == ["1.5", "≤ 2", "yes"]


def test_each_run_names_its_commit_machine_and_isa():
    text = figures.table({"kv": record({"kv_waste_frac": 0.01}, isa="AVX-512 + bf16")})
    run = next(l for l in text.splitlines() if l.startswith("| `kv` | 2026"))
    assert "abc1234" in run and "AVX-512 + bf16" in run and "EPYC, 2 cores, 24 GiB" in run
    assert "| `engine` | not run" in text


def test_the_last_json_object_line_is_the_benchmarks_figures():
    output = 'warming up\n{"not": "last"}\nrow 1\n{"broken": 0, "lost": 0}\n'
    assert figures.last_json_line(output) == {"broken": 0, "lost": 0}
    assert figures.last_json_line("no figures\n[1, 2]\n") is None


def test_isa_names_what_the_kernels_choose_by():
    assert figures.isa({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}) == "AVX-512 + bf16 + AMX"
    assert figures.isa({"avx2", "avx512f", "avx512_bf16"}) == "AVX-512 + bf16"
    assert figures.isa({"avx2", "avx512f"}) == "AVX-512"
    assert figures.isa({"avx2", "fma"}) == "AVX2"
    assert figures.isa({"sse4_2"}) == "no AVX2"


def test_a_benchmarks_output_is_shown_and_kept(capsys):
    code = "import json; print('round 1', flush=True); print(json.dumps({'lost': 0}))"
    returncode, output = figures.passed_through([sys.executable, "-c", code])
    assert returncode == 0 and figures.last_json_line(output) == {"lost": 0}
    assert capsys.readouterr().out == output == 'round 1\n{"lost": 0}\n'


def test_flags_after_a_double_dash_are_the_benchmarks():
    args = figures.parse_args(["run", "--quick", "gguf_quantized", "--", "--isa", "avx2", "--llamacpp-plain-buffers"])
    assert (args.names, args.quick, args.flags) == (["gguf_quantized"], True, ["--isa", "avx2", "--llamacpp-plain-buffers"])
    assert figures.parse_args(["run", "kv"]).flags == []


def test_a_runs_flags_reach_the_benchmark_and_its_row(tmp_path, monkeypatch):
    (tmp_path / "echo.py").write_text("import json, sys\nprint(json.dumps({'argv': sys.argv[1:]}))\n")
    monkeypatch.setattr(figures, "BENCH", tmp_path)
    monkeypatch.setattr(figures, "KEPT", tmp_path / "kept")
    assert figures.run("echo", True, ["--isa", "avx2"])
    kept = figures.kept()["echo@avx2"]
    assert kept["figures"] == {"argv": ["--quick", "--isa", "avx2"]}
    text = figures.table({"echo@avx2": kept, "kv": record({"kv_waste_frac": 0.01})})
    assert next(l for l in text.splitlines() if l.startswith("| `echo@avx2` | 20")).endswith("| --quick --isa avx2 |")
    full = {**record({}), "quick": False}
    assert figures.flags_shown(full) == "full" and figures.flags_shown({**full, "flags": ["--isa", "avx2"]}) == "--isa avx2"


def test_a_run_on_the_avx2_kernels_is_kept_beside_the_native_one():
    assert figures.kept_name("peers", ["--isa", "avx2", "--rounds", "1"]) == "peers@avx2"
    assert figures.kept_name("quantized", ["--kernels=native-avx2"]) == "quantized@avx2"
    assert figures.kept_name("peers", ["--rounds", "1"]) == figures.kept_name("peers", ["--isa", "native"]) == "peers"
    text = figures.table({"quantized": record({"int8_decode_speedup": 3.1}, isa="AVX-512"),
                          "quantized@avx2": record({"int8_decode_speedup": 2.2}, isa="AVX-512")})
    assert row_of(text, "quantized", "int8_decode_speedup")[2:] == ["3.1", "≥ 2.5", "yes"]
    assert row_of(text, "quantized@avx2", "int8_decode_speedup")[2:] == ["2.2", "≥ 2.5", "**no**"]
    assert "| `quantized@avx2` | 2026-11-28 17:00 UTC | abc1234 | EPYC, 2 cores, 24 GiB | AVX-512, AVX2 kernels |" in text

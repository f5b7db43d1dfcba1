"""The benchmarks are not run by CI, but what they import from mcpd must exist: a module moved
in a refactor (the client gate's move broke bench/redteam.py once) fails here, not in an
operator's run."""
import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.rglob("*.py"))


def mcpd_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for every `from mcpd... import name` and (module, None) for `import mcpd...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "mcpd":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "mcpd"]
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_what_a_benchmark_imports_from_mcpd_exists(script):
    for module, name in mcpd_imports(script):
        imported = importlib.import_module(module)
        if name is not None and not hasattr(imported, name):
            # A submodule: found, not imported (int8_cuda needs Triton, which only CUDA machines have).
            assert importlib.util.find_spec(f"{module}.{name}") is not None, f"{module} has no {name}"


def test_no_benchmark_hides_a_standard_library_module():
    """A script runs with bench/ first on sys.path: bench/http.py would hide the standard library's
    `http` from every benchmark (torch imports http.client) and break them all."""
    import sys
    assert sorted(p.stem for p in BENCH.glob("*.py") if p.stem in sys.stdlib_module_names) == []

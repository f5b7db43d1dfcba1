"""Imports run one way: the protocol and the client library stand on their own, and mcpctl and
the security code do not reach into the daemon. Loading the daemon (or numpy, torch, the TOML
loader) where it is not needed costs every client and every `mcpctl` call start-up time, and a
cycle back into the daemon makes the layers impossible to read apart."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mcpd

PACKAGE = Path(mcpd.__file__).parent
HEAVY = ("numpy", "torch")


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    probe = f"import sys\n{code}\nimport json; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def under(modules: set[str], *prefixes: str) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_client_and_protocol_load_nothing_of_the_daemon():
    modules = loaded_after("import mcpd.client, mcpd.protocol.wire, mcpd.protocol.ops, mcpd.protocol.codes, "
                           "mcpd.protocol.control_ops, mcpd.protocol.limits, mcpd.protocol.tenant")
    assert "mcpd.client" in modules   # the probe ran what it should
    assert under(modules, "mcpd.daemon", "mcpd.config", "tomllib", *HEAVY) == []


def test_mcpctl_help_loads_neither_daemon_nor_contexts():
    code = ("from mcpd.cli import mcpctl\n"
            "try:\n    mcpctl.main(['--help'])\nexcept SystemExit:\n    pass")
    modules = loaded_after(code)
    assert "mcpd.cli.contexts" in modules and "mcpd.cli.keys" in modules
    assert under(modules, "mcpd.daemon", "mcpd.contexts", *HEAVY) == []


@pytest.mark.parametrize("package, forbidden", [
    ("protocol", ("mcpd.daemon", "mcpd.config", "mcpd.client", "mcpd.cli", "mcpd.contexts")),
    ("client", ("mcpd.daemon", "mcpd.config", "mcpd.cli", "mcpd.contexts")),
    ("security", ("mcpd.daemon", "mcpd.cli", "mcpd.contexts")),
    ("cli", ("mcpd.daemon", "mcpd.contexts")),
])
def test_no_import_statement_points_back(package, forbidden):
    """Also the imports inside functions, which a fresh interpreter does not run."""
    found = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom)
                     else [])   # `from mcpd.daemon import x` is mcpd.daemon.x, `from mcpd import daemon` too
            found += [f"{path.name}: {n}" for n in names if under({n}, *forbidden)]
    assert found == []


def test_the_scheduler_tokenizes_without_torch():
    """It tokenizes each prompt (mcpd/tokenizer.py); torch is the workers' alone."""
    modules = loaded_after("import mcpd.daemon.scheduler.process, mcpd.tokenizer")
    assert "mcpd.tokenizer" in modules and "tokenizers" in modules
    assert under(modules, "torch", "mcpd.models", "mcpd.engine", "jinja2") == []   # jinja2: chat templates only


def test_a_spawned_child_reimports_only_a_light_main():
    """multiprocessing's spawn runs the parent's main module (the `mcpd` script) again in every
    child, as __mp_main__, before the child's own target: it must not pull in the supervisor's
    graph (aiohttp, prometheus_client, the scheduler's tokenizer) for a child that runs none of it."""
    script = Path(sys.executable).parent / "mcpd"
    modules = loaded_after(f"import runpy; runpy.run_path({str(script)!r}, run_name='__mp_main__')")
    assert "mcpd.__main__" in modules   # the script is the one `pip install -e .` made from pyproject.toml
    assert under(modules, "mcpd.daemon", "aiohttp", "prometheus_client", "tokenizers", *HEAVY) == []


def test_building_a_model_skeleton_does_not_load_torch_dynamo():
    """Every worker and standby builds one on the meta device; a random init there runs through
    torch._refs, which imports torch._dynamo: about a second of CPU each."""
    modules = loaded_after("import torch\n"
                           "from mcpd.config import ModelConfig\n"
                           "from mcpd.models import skeleton\n"
                           "assert len(list(skeleton(ModelConfig(), torch.device('cpu')).parameters())) > 0")
    assert "torch" in modules and "mcpd.models.llama" in modules
    assert under(modules, "torch._dynamo") == []


def test_the_supervisor_loads_no_torch():
    """It only starts and watches processes (daemon/supervisor/: no CUDA context, no torch's start-up
    cost); the pool segment it reads for `reclaim` imports torch only where a pool's bytes are used."""
    modules = loaded_after("import mcpd.daemon.supervisor.process")
    assert "mcpd.memory.pool_segment" in modules   # the probe ran what it should
    assert under(modules, "torch") == []


def test_the_supervisor_loads_prometheus_client_only_for_a_metrics_endpoint():
    """[metrics] listen is off by default; prometheus_client is 0.04 s of CPU at every start."""
    modules = loaded_after("import mcpd.daemon.supervisor.process")
    assert "mcpd.daemon.supervisor.process" in modules   # the probe ran what it should
    assert under(modules, "prometheus_client", "mcpd.daemon.supervisor.metrics") == []


def test_a_cpu_pool_keeper_sizes_and_makes_its_pool_without_torch(tmp_path):
    """It imported torch (a second of CPU at every daemon start) only to size the pool by a
    model skeleton (now parameter_table.py) and to read its device (pool_size.py, pool_segment.cuda_index)."""
    modules = loaded_after("from pathlib import Path\n"
                           "from mcpd.config import from_dict\n"
                           "from mcpd.daemon import pool_keeper\n"
                           "from mcpd.memory.pool_segment import PoolSegment\n"
                           "config = from_dict({'engine': {'pool_bytes': 4 << 20}, 'model': {'quantization': 'int8'}})\n"
                           f"PoolSegment.create(Path({str(tmp_path / 'pool')!r}), Path({str(tmp_path / 'lock')!r}),\n"
                           "                   pool_keeper.pool_bytes(config, 'cpu', 2), 'cpu').close()")
    assert "mcpd.models.parameter_table" in modules   # the probe ran what it should
    assert under(modules, "torch") == []


def test_the_front_end_loads_aiohttp_only_for_an_http_listener():
    """aiohttp is 0.15 s of the front-end's CPU at every start; most daemons open no [http] listener."""
    modules = loaded_after("import mcpd.daemon.frontend.process")
    assert "mcpd.daemon.frontend.process" in modules   # the probe ran what it should
    assert under(modules, "aiohttp", "mcpd.http.server", "torch") == []


def test_the_front_end_loads_neither_the_contexts_nor_numpy():
    """It relays requests and replies; contexts live in the scheduler. Importing
    mcpd.contexts.service for tenant_of loaded the store, the host cache, zstandard and numpy:
    0.1 s of the front-end's CPU at every start."""
    modules = loaded_after("import mcpd.daemon.frontend.process")
    assert "mcpd.protocol.tenant" in modules   # the probe ran what it should
    assert under(modules, "mcpd.contexts", "numpy", "zstandard") == []


def import_graph() -> dict[str, set[str]]:
    """Each mcpd module's imports of other mcpd modules, those inside functions too; `from
    package import module` points at the module, not at the package's __init__."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path of imports from `start` back to it, if there is one (depth first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        name, path = stack.pop()
        for imported in sorted(graph[name]):
            if imported == start:
                return path + [start]
            if imported not in seen:
                seen.add(imported)
                stack.append((imported, path + [imported]))
    return None


def test_the_import_graph_is_found():
    graph = import_graph()
    assert "mcpd.kernels.torch_kernels" in graph["mcpd.kernels.cuda_kernels"]
    assert cycle_through({"a": {"b"}, "b": {"a"}}, "a") == ["a", "b", "a"]


def test_no_module_imports_itself_in_a_circle():
    """A circle makes the rooms impossible to read apart, and works only by the order imports run."""
    graph = import_graph()
    circles = [cycle_through(graph, name) for name in sorted(graph)]
    assert [c for c in circles if c] == []

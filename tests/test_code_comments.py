"""Code in mcpd/ reads whole: files and functions short enough to read at once, and comments
that explain the code as it is, a reason a reader can check against the code. Where a figure
came from (a scratch script, an issue's number) belongs in git's history and bench/README.md,
where it can be dated; in the code it goes stale and points at nothing."""
import ast
import re
from pathlib import Path

import mcpd

PACKAGE = Path(mcpd.__file__).parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60
NARRATION = re.compile(r"\.probe/|\.probe |\bissues? #?\d+\b", re.IGNORECASE)
# A run's figures and the story around them: a throughput, a figure against another, a range of
# timings, the machine it ran on, "Before, ...". A unit's meaning ("about 0.2 ms of spinning") passes.
MEASURED = re.compile(r"tok/s|tokens/s|[KMG]i?B/s|GFLOP/s|req/s|\bBefore,|\bBefore this\b"
                      r"|\bagainst ~?\d|\d ?(?:ms|us|µs|ns|s)\)? against\b|\d-\d+(?:\.\d+)? ?(?:ms|us|µs|ns)\b"
                      r"|\btook ~?\d|\bvCPUs?\b|\b[Mm]easured (?:on|there|side by side)\b")


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c", ".h", ".toml", ".jinja"))


def test_sources_are_found():
    names = {p.name for p in sources()}
    assert {"process.py", "kernels.c"} <= names


def lines_matching(pattern: re.Pattern) -> list[str]:
    return [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}" for p in sources()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]


def test_no_scratch_scripts_or_issue_numbers_in_the_code():
    found = lines_matching(NARRATION)
    assert found == [], "\n".join(found)


def test_no_measurements_or_histories_in_the_code():
    """A comment gives the reason for the code as it is now. A run's figures and how things were
    before go stale and cannot be checked against the code: bench/ measures, git remembers."""
    found = lines_matching(MEASURED)
    assert found == [], "\n".join(found)


def test_files_and_functions_stay_short():
    """One noun per file and short functions: no mcpd/ Python file over MAX_FILE_LINES lines, no
    function over MAX_FUNCTION_LINES (kernels.c, C, is measured by its own comments)."""
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(PACKAGE)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    assert long_files == [] and long_functions == [], "\n".join(long_files + long_functions)

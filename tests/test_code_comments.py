"""Comments in mcpd/ explain the code as it is: a reason a reader can check against the code.
Where a figure came from (a scratch script, an issue's number) belongs in git's history and
bench/README.md, where it can be dated; in the code it goes stale and points at nothing."""
import re
from pathlib import Path

import mcpd

PACKAGE = Path(mcpd.__file__).parent
NARRATION = re.compile(r"\.probe/|\.probe |\bissues? #?\d+\b", re.IGNORECASE)


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c", ".h", ".toml", ".jinja"))


def test_sources_are_found():
    names = {p.name for p in sources()}
    assert {"process.py", "kernels.c"} <= names


def test_no_scratch_scripts_or_issue_numbers_in_the_code():
    found = [f"{p.relative_to(PACKAGE)}:{n}: {line.strip()}" for p in sources()
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if NARRATION.search(line)]
    assert found == [], "\n".join(found)

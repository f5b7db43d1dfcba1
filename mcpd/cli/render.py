"""mcpctl's output: JSON with --json, otherwise plain aligned tables for a terminal."""
from __future__ import annotations

import json


def emit(args, data, human) -> None:
    """Print `data` as JSON (--json) or as human(data)."""
    print(json.dumps(data, indent=2) if args.json else human(data))


def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"

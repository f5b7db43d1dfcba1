"""mcpctl's output: JSON with --json, otherwise plain aligned tables for a terminal."""
from __future__ import annotations

import json
import signal
import sys
import threading

CLEAR = "\033[H\033[2J"


def emit(args, data, human) -> None:
    """Print `data` as JSON (--json) or as human(data)."""
    print(json.dumps(data, indent=2) if args.json else human(data))


def redraw_until_interrupted(args, fetch, human, interval_s: float) -> None:
    """Print fetch()'s data every interval_s until Ctrl-C; on a terminal each frame replaces the
    last (ANSI clear), elsewhere frames follow one another. Ctrl-C ends the watch between frames:
    raised inside a control call it could land in libzmq's context teardown and leave the process
    hung at exit."""
    clear = not args.json and sys.stdout.isatty()
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        while not interrupted.is_set():
            data = fetch()
            if clear:
                print(CLEAR, end="")
            emit(args, data, human)
            sys.stdout.flush()
            interrupted.wait(interval_s)
    finally:
        signal.signal(signal.SIGINT, previous)


def table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"

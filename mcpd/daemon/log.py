"""One log line per event on stderr, with the process role in it (journald adds the time)."""
from __future__ import annotations

import logging
import sys


def setup(role: str, level: str = "info") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s mcpd[{role}] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return logging.getLogger(f"mcpd.{role}")

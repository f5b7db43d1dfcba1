"""Handlers that break their contract on purpose, for the daemon's tests (tests/test_handlers_daemon.py
puts this directory on the workers' PYTHONPATH). Each is RiskRules (mcpd/handlers/examples) until
a batch holds a row whose first feature is a trigger value."""
from __future__ import annotations

import sys
import threading

import numpy as np

from mcpd.handlers.examples.risk_scorer import RiskRules

RAISE, WRONG_ROWS, HANG, EXIT = 666.0, 777.0, 888.0, 999.0
_released = threading.Event()   # clear: a HANG row hangs its predict until it is set


def release_hung() -> None:
    """Let every hung predict of this process return, and later ones not hang (a teardown)."""
    _released.set()


def hang_again() -> None:
    _released.clear()


class Faulty(RiskRules):
    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        first = batch["features"][:, 0]
        if (first == RAISE).any():
            raise RuntimeError("this handler raises on purpose")
        if (first == EXIT).any():
            sys.exit("this handler exits on purpose")
        if (first == HANG).any():
            _released.wait()
        outputs = super().predict(batch)
        if (first == WRONG_ROWS).any():
            return {"score": outputs["score"][:-1]}
        return outputs


class ExitsInSetup(RiskRules):
    def setup(self, device: str, settings: dict) -> None:
        sys.exit("this handler exits on purpose")

"""A handler for the daemon's tests (test_worker_gc.py puts this directory on the workers'
PYTHONPATH): RiskRules whose score is how many objects its process keeps out of the garbage
collector's reach (gc.freeze), as its worker sees it while serving."""
from __future__ import annotations

import gc

import numpy as np

from mcpd.handlers.examples.risk_scorer import RiskRules


class FrozenCount(RiskRules):
    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"score": np.full(len(batch["features"]), gc.get_freeze_count(), np.float32)}

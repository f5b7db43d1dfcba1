"""A handler over a window of events, for tests/test_handler_context_inputs.py (which puts this
directory on the workers' PYTHONPATH): each row is one window of events, and the answer is the
window's sum and its number of events, so a reply shows which rows the window held."""
from __future__ import annotations

import numpy as np

from mcpd.handlers.handler import Handler
from mcpd.handlers.tensors import TensorSpec

EVENT_FIELDS = 2


class WindowSum(Handler):
    inputs = {"events": TensorSpec("FP32", (-1, -1, EVENT_FIELDS))}
    outputs = {"total": TensorSpec("FP32", (-1, EVENT_FIELDS)), "count": TensorSpec("INT64", (-1,))}

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"total": batch["events"].sum(axis=1), "count": batch["events.lengths"]}   # padding adds zeros

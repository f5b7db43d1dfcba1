"""What a model itself gains from batching on this CPU, measured in the bench's own process: the
handler's predict() time per row at batch 1 against at its largest batch, over the same inputs.
mcpd's batching_speedup (end to end, through the daemon) is read beside it: the daemon cannot
gain more from batching than predict does.

The inputs are preprocessed before anything is timed and, for the large batches, sorted by
length first (as length bins group them), so padding costs as little as it can: the best case,
a ceiling. Both sizes run in turns and the best turn of each is kept, so a neighbour's burst on a
shared machine does not land on one side only."""
from __future__ import annotations

import time

import numpy as np

from mcpd.handlers import batch_tensors
from peerkit.handler_runner import HandlerRunner

ROUNDS = 5


def batching_ceiling(runner: HandlerRunner, requests: list[dict[str, np.ndarray]], max_batch: int,
                     threads: int) -> dict:
    """{"batch_1_us_per_row", "batch_<max_batch>_us_per_row", "ceiling"}: predict's time per row,
    and batch 1's over the largest batch's (how many times faster a row is in a full batch)."""
    import torch

    torch.set_num_threads(threads)
    handler = runner.handler
    prepared = sorted((handler.preprocess(inputs) for inputs in requests),
                      key=lambda inputs: batch_tensors.length_of(inputs, handler.inputs))
    alone = [_assembled([inputs], handler) for inputs in prepared]
    full = [_assembled(prepared[at:at + max_batch], handler) for at in range(0, len(prepared), max_batch)]
    best_alone, best_full = float("inf"), float("inf")
    for _ in range(ROUNDS):
        best_alone = min(best_alone, _predict_seconds(handler, alone))
        best_full = min(best_full, _predict_seconds(handler, full))
    rows = len(prepared)
    return {"batch_1_us_per_row": round(best_alone / rows * 1e6, 1),
            f"batch_{max_batch}_us_per_row": round(best_full / rows * 1e6, 1),
            "ceiling": round(best_alone / best_full, 2)}


def _assembled(requests: list[dict[str, np.ndarray]], handler) -> dict[str, np.ndarray]:
    batch, _, _ = batch_tensors.assemble(requests, handler.inputs)
    return batch


def _predict_seconds(handler, batches: list[dict[str, np.ndarray]]) -> float:
    started = time.perf_counter()
    for batch in batches:
        handler.predict(batch)
    return time.perf_counter() - started

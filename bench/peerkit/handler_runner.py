"""A mcpd Handler run the way mcpd's worker runs it, inside a peer server (LitServe, MLServer), so
every server computes the same thing: each request through `preprocess`, the requests' rows
concatenated (a variable dim padded with zeros to the batch's longest, "<input>.lengths" beside
it), one `predict`, the rows split back per request, each through `postprocess`.

Imported in the peers' own venvs (PYTHONPATH names the repo): numpy and the Handler only.
"""
from __future__ import annotations

import numpy as np

from mcpd.handlers.handler import Handler, load_handler


class HandlerRunner:
    def __init__(self, reference: str, settings: dict):
        self.handler: Handler = load_handler(reference)
        self.handler.setup("cpu", settings)

    def run(self, requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        prepared = [self.handler.preprocess(inputs) for inputs in requests]
        rows = [len(next(iter(inputs.values()))) for inputs in prepared]
        outputs = self.handler.predict(collate(prepared))
        total = sum(rows)
        for name, array in outputs.items():
            if len(array) != total:
                raise RuntimeError(f"handler returned {len(array)} rows of {name!r} for {total}")
        bounds = np.cumsum([0, *rows])
        return [self.handler.postprocess({name: array[start:end] for name, array in outputs.items()})
                for start, end in zip(bounds[:-1], bounds[1:])]


def collate(requests: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The requests' inputs concatenated on dim 0; an input whose other dims differ between the
    requests is padded with zeros to the longest, with its rows' lengths (dim 1) beside it."""
    batch = {}
    for name in requests[0]:
        arrays = [inputs[name] for inputs in requests]
        if len({a.shape[1:] for a in arrays}) == 1:
            batch[name] = np.concatenate(arrays)
            continue
        longest = tuple(max(sizes) for sizes in zip(*(a.shape[1:] for a in arrays)))
        padded = np.zeros((sum(len(a) for a in arrays), *longest), dtype=arrays[0].dtype)
        row = 0
        for array in arrays:
            padded[(slice(row, row + len(array)), *(slice(0, size) for size in array.shape[1:]))] = array
            row += len(array)
        batch[name] = padded
        batch[f"{name}.lengths"] = np.concatenate([np.full(len(a), a.shape[1], np.int64) for a in arrays])
    return batch

"""A mcpd Handler run the way mcpd's worker runs it (daemon/worker/handler_core.py), inside a peer
server (LitServe, MLServer), so every server computes the same thing: each request through
`preprocess`, the requests' rows put together by mcpd's own batch_tensors (a variable dim padded
to the batch's longest, "<input>.lengths" beside it), one `predict`, the rows split back per
request, each through `postprocess`.

Imported in the peers' own venvs (PYTHONPATH names the repo): numpy and mcpd.handlers only.
"""
from __future__ import annotations

import numpy as np

from mcpd.handlers import batch_tensors
from mcpd.handlers.handler import Handler, load_handler


class HandlerRunner:
    def __init__(self, reference: str, settings: dict, device: str = "cpu"):
        self.handler: Handler = load_handler(reference)
        self.handler.setup(device, settings)

    def run(self, requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        prepared = [self.handler.preprocess(inputs) for inputs in requests]
        rows = [len(next(iter(inputs.values()))) for inputs in requests]
        batch, _, _ = batch_tensors.assemble(prepared, self.handler.inputs)
        parts = batch_tensors.split(self.handler.predict(batch), rows)
        return [self.handler.postprocess(part) for part in parts]

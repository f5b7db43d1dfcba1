"""An MLServer runtime serving a mcpd Handler (peerkit/handler_runner.py), loaded by MLServer in
its own venv (bench/handlers.py writes the model-settings.json naming it, with the handler and its
settings under parameters.extra). MLServer's adaptive batching merges the requests' rows into one
payload; the runner takes each row as the request it came from (every request of the bench is one
row), so preprocess and postprocess run per request as in mcpd."""
from __future__ import annotations

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.types import InferenceRequest, InferenceResponse

from peerkit.handler_runner import HandlerRunner


class HandlerRuntime(MLModel):
    async def load(self) -> bool:
        extra = self.settings.parameters.extra
        self.runner = HandlerRunner(extra["handler"], extra.get("settings", {}))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {request_input.name: decoded(request_input) for request_input in payload.inputs}
        rows = len(next(iter(inputs.values())))
        outputs = self.runner.run([{name: array[row:row + 1] for name, array in inputs.items()} for row in range(rows)])
        merged = {name: np.concatenate([output[name] for output in outputs]) for name in outputs[0]}
        return InferenceResponse(model_name=self.name,
                                 outputs=[NumpyCodec.encode_output(name, array) for name, array in merged.items()])


def decoded(request_input) -> np.ndarray:
    """numpy as the Handler takes it: BYTES as an object array of bytes."""
    if request_input.datatype != "BYTES":
        return NumpyCodec.decode_input(request_input)
    items = np.empty(len(StringCodec.decode_input(request_input)), dtype=object)
    items[:] = [text.encode() for text in StringCodec.decode_input(request_input)]
    return items.reshape(request_input.shape)

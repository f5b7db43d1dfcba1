"""Named tensors in the Open Inference Protocol's (KServe v2) JSON form, the request body every
HTTP server of bench/handlers.py gets: {"inputs": [{"name", "datatype", "shape", "data"}]}, the
data flattened in C order, BYTES elements as UTF-8 strings. numpy only (the peers' venvs import it)."""
from __future__ import annotations

import json

import numpy as np

DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
             "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": object}
NAMES = {np.dtype(dtype): name for name, dtype in DATATYPES.items() if name != "BYTES"}


def tensor(name: str, array: np.ndarray) -> dict:
    if array.dtype == object:
        data = [item.decode() if isinstance(item, bytes) else str(item) for item in array.ravel()]
        return {"name": name, "datatype": "BYTES", "shape": list(array.shape), "data": data}
    return {"name": name, "datatype": NAMES[array.dtype], "shape": list(array.shape), "data": array.ravel().tolist()}


def array(tensor: dict) -> np.ndarray:
    if tensor["datatype"] == "BYTES":
        items = np.empty(len(tensor["data"]), dtype=object)
        items[:] = [item.encode() for item in tensor["data"]]
        return items.reshape(tensor["shape"])
    return np.asarray(tensor["data"], dtype=DATATYPES[tensor["datatype"]]).reshape(tensor["shape"])


def request_body(inputs: dict[str, np.ndarray]) -> bytes:
    return json.dumps({"inputs": [tensor(name, a) for name, a in inputs.items()]}).encode()


def inputs_of(body: dict) -> dict[str, np.ndarray]:
    return {t["name"]: array(t) for t in body["inputs"]}


def response_body(model: str, outputs: dict[str, np.ndarray]) -> dict:
    return {"model_name": model, "outputs": [tensor(name, a) for name, a in outputs.items()]}

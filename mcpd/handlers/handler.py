"""The interface a model implements to be served by mcpd other than as a language model: a
scorer, a classifier, an embedder, any batched torch or numpy model.

A worker loads the class named in its version's config (`handler = "package.module:Class"`),
calls `setup` once, then runs batches: each request's inputs through `preprocess` (on the CPU,
while the previous batch is on the device), the batch through `predict`, each request's rows
through `postprocess`.
"""
from __future__ import annotations

import importlib

import numpy as np

from mcpd.handlers.tensors import TensorSpec


class Handler:
    """Subclass it. `inputs` and `outputs` declare the named tensors (tensors.TensorSpec); the
    first dim of each is the batch's rows."""
    inputs: dict[str, TensorSpec] = {}
    outputs: dict[str, TensorSpec] = {}
    model = None   # a torch.nn.Module, when setup builds one: quantization = "int8" quantizes its nn.Linear

    def setup(self, device: str, settings: dict) -> None:
        """Load or build the model on `device` ("cpu", "cuda:0"), with the version's `settings`."""

    def preprocess(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's inputs as predict takes them (tokenize text, say); the rows stay the rows."""
        return inputs

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs for a batch: the requests' rows concatenated on dim 0, a variable dim padded
        with zeros to the batch's longest, with "<input>.lengths" (int64, per row) beside each
        padded input. Each output has one row per batch row. The one method a handler must
        write: a subclass without it fails each batch with this reason (INTERNAL, per request)."""
        raise NotImplementedError(f"{type(self).__name__} does not define predict")

    def postprocess(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's rows of the outputs as the client gets them."""
        return outputs


def load_handler(reference: str) -> Handler:
    """An instance of the class `reference` names ("package.module:Class"). Raises ValueError
    with the reason: a config names it, and a typo must say what it is."""
    module_name, _, class_name = reference.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"handler = {reference!r}: name it as \"package.module:Class\"")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"handler = {reference!r}: cannot import {module_name}: {e}") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Handler)):
        raise ValueError(f"handler = {reference!r}: {module_name} has no Handler subclass {class_name}")
    return cls()

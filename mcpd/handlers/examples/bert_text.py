"""What the text classifier and the sentence embedder share: a BERT-shaped model's config from
the version's settings, built with random weights from a seed (no download), the WordPiece
tokenizer (wordpiece.py) as preprocess, and the attention mask of a padded batch."""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch
from transformers import BertConfig

from mcpd.handlers.examples.traced_forward import traced_forward
from mcpd.handlers.examples.wordpiece import PAD_ID, build_tokenizer, token_ids, vocabulary
from mcpd.handlers.handler import Handler
from mcpd.handlers.tensors import DTYPES, TensorSpec

# settings key -> (default, lowest, highest): an operator's typo must refuse the start, not
# build a model that fills the machine
SETTINGS = {"layers": (2, 1, 24), "hidden": (128, 8, 4096), "heads": (4, 1, 64), "max_length": (128, 4, 8192),
            "seed": (0, 0, (1 << 63) - 1)}
# BERT's own 0.02 gives every text nearly the same output (a classifier then labels all texts
# alike); 0.1 spreads random-weight outputs over the labels as a trained model's are spread
INIT_RANGE = 0.1
# Rows per forward: a request of more rows than max_batch_size runs alone, and its activations
# (rows x tokens x hidden, attention rows x heads x tokens^2) must not grow with it
CHUNK_ROWS = 64


class BertTextHandler(Handler, ABC):
    """One UTF-8 string per row in, a BERT-shaped model over its token ids."""
    inputs = {"text": TensorSpec("BYTES", (-1,))}
    extra_settings: dict[str, tuple[int, int, int]] = {}   # a subclass's own keys, as SETTINGS
    _model: torch.nn.Module | None = None

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        """Setup builds it, quantization = "int8" replaces it: predict runs the graph of this one."""
        self._model = model
        self._graph = traced_forward(model, self.forward, vocabulary()["[CLS]"], self.device)

    def setup(self, device: str, settings: dict) -> None:
        values = checked_settings(settings, {**SETTINGS, **self.extra_settings})
        self.device = torch.device(device)
        self.tokenizer = build_tokenizer(values["max_length"])
        config = BertConfig(vocab_size=len(vocabulary()), hidden_size=values["hidden"],
                            num_hidden_layers=values["layers"], num_attention_heads=values["heads"],
                            intermediate_size=4 * values["hidden"], max_position_embeddings=values["max_length"],
                            pad_token_id=PAD_ID, initializer_range=INIT_RANGE, **self.config_extras(values))
        self.outputs = self.outputs_for(values)
        with torch.random.fork_rng(devices=[]):   # the seed decides the weights, and leaves the caller's RNG be
            torch.manual_seed(values["seed"])
            self.model = self.build_model(config).eval().to(self.device)

    @abstractmethod
    def build_model(self, config: BertConfig) -> torch.nn.Module:
        """The transformers model the subclass runs, built from `config`."""

    def config_extras(self, values: dict) -> dict:
        """BertConfig's keys that a subclass's settings decide."""
        return {}

    @abstractmethod
    def outputs_for(self, values: dict) -> dict[str, TensorSpec]:
        """The outputs with the dims the settings decide."""

    def preprocess(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"input_ids": token_ids(self.tokenizer, inputs["text"])}

    @torch.inference_mode()   # predict runs on the worker's predict thread: grad mode is per thread
    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """forward over CHUNK_ROWS rows at a time, each chunk cut to its longest row. The mask
        marks the ids that are not PAD_ID, rather than reading "input_ids.lengths": a request
        of several rows arrives padded to its own longest by preprocess, so the batcher's length
        of such a row is its request's; no text tokenizes to PAD_ID."""
        ids = torch.from_numpy(np.ascontiguousarray(batch["input_ids"], np.int64))
        if not len(ids):
            return {name: np.zeros((0, *spec.shape[1:]), DTYPES[spec.datatype]) for name, spec in self.outputs.items()}
        parts = []
        for chunk in ids.split(CHUNK_ROWS):
            mask = chunk != PAD_ID
            longest = int(mask.sum(1).max())
            parts.append(self._graph(chunk[:, :longest].to(self.device), mask[:, :longest].long().to(self.device)))
        return {name: torch.cat([part[name] for part in parts]).cpu().numpy() for name in parts[0]}

    @abstractmethod
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The outputs of a chunk of rows: token ids and their attention mask. Traced once
        (traced_forward.py): its Python runs only then, so it must not branch on the values."""


def checked_settings(settings: dict, allowed: dict[str, tuple[int, int, int]]) -> dict[str, int]:
    """The settings with defaults filled in, or ValueError naming the key that is wrong."""
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"settings {', '.join(unknown)}: not one of {', '.join(allowed)}")
    values = {}
    for key, (default, lowest, highest) in allowed.items():
        value = settings.get(key, default)
        if type(value) is not int or not lowest <= value <= highest:
            raise ValueError(f"settings.{key} = {value!r}: an integer {lowest}..{highest}")
        values[key] = value
    if values["hidden"] % values["heads"]:
        raise ValueError(f"settings.hidden = {values['hidden']}: a multiple of settings.heads = {values['heads']}")
    return values

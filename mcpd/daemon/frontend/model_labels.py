"""The model a request's figures are labelled with: a configured model's name, never a client's word.

A request may name any model; each name a client invents would be a new series on /metrics, so
an attacker could grow the endpoint without bound. Only [models]' names (fixed for the daemon's
life: a new model needs a restart) become labels; every other name shares UNKNOWN.
"""
from __future__ import annotations

from mcpd.config import Config

NO_MODEL = ""            # ops that name no model: ping, status, context.*
UNKNOWN = "(unknown)"    # not a valid model name (config/models.py MODEL_NAME), so no model can take it
_NOT_AN_ARG = object()


class ModelLabels:
    def __init__(self, config: Config):
        self.names = frozenset(config.model_table)
        self.default = config.default_model

    def reconfigure(self, config: Config) -> None:
        """The default model changes live, as the scheduler takes it: only to a model it serves."""
        if config.default_model in self.names:
            self.default = config.default_model

    def of(self, args) -> str:
        model = getattr(args, "model", _NOT_AN_ARG)
        if model is _NOT_AN_ARG:
            return NO_MODEL
        if model is None:
            return self.default
        return model if model in self.names else UNKNOWN

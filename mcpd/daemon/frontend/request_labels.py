"""The model and priority class a request's figures are labelled with: configured names only,
never a client's word.

A request may name any model or class; each name a client invents would be a new series on
/metrics (and a histogram in memory), so an attacker could grow both without bound. Only names
the config has become labels; every other one shares UNKNOWN. Models are fixed for the daemon's
life (a new one needs a restart); classes and the defaults change live, as the scheduler takes them.
"""
from __future__ import annotations

from mcpd.config import Config

NO_MODEL = ""            # ops that name no model: ping, status, context.*
UNKNOWN = "(unknown)"    # neither a valid model name (config/models.py) nor a class name (config/scheduler.py)
_NOT_AN_ARG = object()


class RequestLabels:
    def __init__(self, config: Config):
        self.models = frozenset(config.model_table)
        self.default_model = config.default_model
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """A reload: the scheduler takes every class and the default class, and a default model
        only if it serves it already."""
        classes = config.scheduler.classes
        self.classes = frozenset(classes)
        self.default_class = config.scheduler.default_class
        self.urgent = config.scheduler.urgent_classes
        if config.default_model in self.models:
            self.default_model = config.default_model

    def model_of(self, args) -> str:
        model = getattr(args, "model", _NOT_AN_ARG)
        if model is _NOT_AN_ARG:
            return NO_MODEL
        if model is None:
            return self.default_model
        return model if model in self.models else UNKNOWN

    def class_of(self, priority: str | None) -> str:
        if priority is None:
            return self.default_class
        return priority if priority in self.classes else UNKNOWN

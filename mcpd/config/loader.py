"""Reading a TOML file into a validated `Config`: every key checked against its section's types and
every number against its field's range (mcpd/config_bounds.py), then every section's own checks,
then the checks across sections."""
from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing

from mcpd import config_bounds, small_file
from mcpd.config.listeners import is_loopback
from mcpd.config.models import LEGACY_NAME, MAX_MODEL_WORKERS
from mcpd.config.tree import Config
from mcpd.config_error import ConfigError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_CONFIG_BYTES = 16 << 20   # a config is kilobytes: a log or /dev/zero named by mistake is not read whole


def load(path: str | os.PathLike | None) -> Config:
    """Read a TOML file (None = all defaults) and return a validated Config."""
    if path is None:
        return from_dict({})
    try:
        raw = tomllib.loads(small_file.read_text(path, MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except small_file.NotSmallFile as e:   # a reload must never take the daemon down for a file's bytes
        raise ConfigError(f"config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except ValueError:   # tomllib's int() of a literal past Python's 4300 digits
        raise ConfigError(f"config file {path}: a number too long to read") from None
    except RecursionError:   # tomllib recurses per nested array or inline table
        raise ConfigError(f"config file {path}: arrays or tables nest too deep to read") from None
    return from_dict(raw)


def from_dict(raw: dict) -> Config:
    sections = {}
    hints = typing.get_type_hints(Config)
    for name, value in raw.items():
        if name not in hints:
            raise ConfigError(f"unknown section [{name}]; known: {', '.join(hints)}")
        if not isinstance(value, dict):
            raise ConfigError(f"[{name}] must be a table")
        sections[name] = (_build_value(name, value, hints[name]) if typing.get_origin(hints[name]) is dict
                          else _build_section(name, hints[name], value))
    config = Config(**sections)
    for section in dataclasses.fields(config):
        if section.name != "models":
            getattr(config, section.name).check()
    _check_models(config, raw)
    _check_exposure(config)
    return config


def _check_models(config: Config, raw: dict) -> None:
    """[models] replaces [model] and workers.count: a file with both would say two things."""
    if not config.models:
        if config.routing.default_model not in ("", LEGACY_NAME):
            raise ConfigError(f"routing.default_model = {config.routing.default_model!r}: there is no [models] "
                              f"table; the one model of [model] is called {LEGACY_NAME!r}")
        return
    if "model" in raw:
        raise ConfigError("[model] and [models] are both set: use [models.<name>.versions.<version>] alone "
                          "(each version takes what [model] held)")
    if "count" in raw.get("workers", {}):
        raise ConfigError("workers.count is set with [models]: each version's `workers` says how many serve it")
    for name, entry in config.models.items():
        entry.check(name)
    if config.routing.default_model and config.routing.default_model not in config.models:
        raise ConfigError(f"routing.default_model = {config.routing.default_model!r}: not one of [models] "
                          f"({', '.join(config.models)})")
    if len(config.worker_versions()) > MAX_MODEL_WORKERS:
        raise ConfigError(f"[models]: {len(config.worker_versions())} workers in all; at most {MAX_MODEL_WORKERS}")


def _check_exposure(config: Config) -> None:
    """Refuse to serve plaintext beyond loopback unless the operator said so in as many words."""
    tcp, security = config.server.tcp, config.security
    if tcp and not is_loopback(tcp) and not security.curve_on(tcp) and not security.allow_plaintext_non_loopback:
        raise ConfigError(f"server.tcp = {tcp!r} is not a loopback address and security.curve = 'off': "
                          "anyone who can reach it could use the daemon. Turn CURVE on (security.curve = "
                          "'on' or 'auto', keys with `mcpctl keys`), bind loopback, or set "
                          "security.allow_plaintext_non_loopback = true on a trusted network")


def _build_section(section: str, cls: type, values: dict):
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown key {section}.{key}; known: {', '.join(hints)}")
        if not _matches(value, hints[key]):
            raise ConfigError(f"{section}.{key} = {_shown(value)}: expected {_type_name(hints[key])}")
        if _holds_nul(value):
            raise ConfigError(f"{section}.{key} = {_shown(value)}: holds a NUL character")
    built = {k: _build_value(f"{section}.{k}", v, hints[k]) for k, v in values.items()}
    config_bounds.check(section, cls, built)
    return cls(**built)


def _holds_nul(value) -> bool:
    """A NUL in a string, or in a list's strings: C ends a path, a group's name or a URL there."""
    return any(isinstance(text, str) and "\0" in text for text in (value if isinstance(value, list) else [value]))


def _build_value(path: str, value, hint):
    if dataclasses.is_dataclass(hint):   # a sub-table, e.g. [models.<name>.versions.<v>.batching]
        return _build_section(path, hint, value)
    if typing.get_origin(hint) is tuple:   # a list of values, e.g. length_bins
        return tuple(value)
    if typing.get_origin(hint) is dict and not dataclasses.is_dataclass(typing.get_args(hint)[1]):
        item = typing.get_args(hint)[1]   # a table of values, e.g. models.<name>.split
        for name, item_value in value.items():
            if not _matches(item_value, item):
                raise ConfigError(f"{path}.{name} = {_shown(item_value)}: expected {_type_name(item)}")
        return {name: _build_value(f"{path}.{name}", v, item) for name, v in value.items()}
    if typing.get_origin(hint) is dict:   # a table of tables, e.g. [scheduler.classes.<name>]
        item = typing.get_args(hint)[1]
        for name, table in value.items():
            if not isinstance(table, dict):
                raise ConfigError(f"[{path}.{name}] must be a table")
        return {name: _build_section(f"{path}.{name}", item, table) for name, table in value.items()}
    return float(value) if hint is float else value


def _matches(value, hint) -> bool:
    if isinstance(value, bool):  # bool is an int in Python; never accept it for numbers
        return hint is bool
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        return False   # TOML's integers are 64-bit; tomllib reads any, and ZeroMQ, torch and floats overflow
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    if typing.get_origin(hint) is tuple:   # tuple[X, ...]: TOML's array of X
        item = typing.get_args(hint)[0]
        return isinstance(value, (list, tuple)) and all(_matches(v, item) for v in value)
    if hint is float:   # nan passes every range check (nan < 0 is false) and inf overflows them
        return isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(hint, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    return isinstance(value, typing.get_origin(hint) or hint)


def _shown(value) -> str:
    try:
        return repr(value)
    except ValueError:   # an int of over 4300 digits (a TOML hex literal reaches one) has no repr
        return "(a number too long to show)"


def _type_name(hint) -> str:
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return "a list of " + {int: "integers", float: "finite numbers", str: "strings"}.get(item, str(item))
    return {int: "a 64-bit integer", float: "a finite number", str: "a string", bool: "true or false"}.get(
        hint, "a table" if typing.get_origin(hint) is dict or dataclasses.is_dataclass(hint) else str(hint))

"""Typed reads of a model's config.json fields. The file is a stranger's: a string where a list
belongs would be iterated letter by letter, "false" taken as true, a 0 where a count belongs
taken by `or` as absent. Each read refuses a value of the wrong JSON type with BadField, naming
the key and the value; architecture.py adds the file. A field absent or null takes its default,
as transformers reads it. The bounds of sizes are model_sizes.py's.
"""
from __future__ import annotations

import math

REQUIRED = object()   # a count without a default: absent, it is a KeyError ("lacks ...")


class BadField(ValueError):
    """A config.json field whose value mcpd cannot take; the message names both."""


def flag(table: dict, key: str, default: bool, name: str | None = None) -> bool:
    value = table.get(key)
    if value is None:
        return default
    if type(value) is not bool:
        raise BadField(f"{name or key} {shown(value)} is not true or false")
    return value


def text(table: dict, key: str, default: str | None) -> str | None:
    value = table.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadField(f"{key} {shown(value)} is not a string")
    return value


def mapping(table: dict, key: str, name: str | None = None) -> dict:
    """The JSON object under key ({} where there is none); name: how the message calls it."""
    value = table.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadField(f"{name or key} {shown(value)} is not a JSON object")
    return value


def count(table: dict, key: str, default=REQUIRED, least: int = 1, most: int | None = None, name: str | None = None):
    """A whole number from `least` (to `most`, where a list of that many is made before
    model_sizes.check sees it), or default; a bool is none, and a 0 is refused, not taken
    as absent."""
    value = table.get(key)
    if value is None:
        if default is REQUIRED:
            raise KeyError(key)
        return default
    if type(value) is not int or value < least or (most is not None and value > most):
        bounds = f"from {least} to {most}" if most is not None else f"of at least {least}"
        raise BadField(f"{name or key} {shown(value)} is not a whole number {bounds}")
    return value


def real(table: dict, key: str, default, name: str | None = None, zero: bool = False):
    """A finite positive number (zero: or 0), or default."""
    value = table.get(key)
    if value is None:
        return default
    if not finite(value) or value < 0 or (value == 0 and not zero):
        raise BadField(f"{name or key} {shown(value)} is not a finite {'non-negative' if zero else 'positive'} number")
    return value


def reals(table: dict, key: str, name: str | None = None) -> tuple[float, ...]:
    """A list of finite positive numbers (required)."""
    values = table[key]
    if not isinstance(values, list):
        raise BadField(f"{name or key} {shown(values)} is not a list of finite positive numbers")
    for value in values:
        if not finite(value) or value <= 0:
            raise BadField(f"{name or key} {shown(value)} is not a finite positive number")
    return tuple(values)


def finite(value) -> bool:
    """A JSON number that is finite (a whole number of any length is)."""
    return type(value) is int or (type(value) is float and math.isfinite(value))


def shown(value) -> str:
    """value as a refusal quotes it: a whole number of more than 20 digits as its first digits
    and its length (a 300-digit product says no more), anything else cut to 100 characters."""
    if type(value) is int and abs(value) >= 10 ** 20:
        size = abs(value)
        digits = int(size.bit_length() * math.log10(2))   # not str(): it refuses past 4300 digits
        digits += 10 ** digits <= size
        return f"{'-' if value < 0 else ''}{size // 10 ** (digits - 8)}...({digits} digits)"
    return f"{value!r:.100}"


def names(table: dict, key: str) -> list[str]:
    """A list of strings (absent: empty)."""
    value = table.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadField(f"{key} {shown(value)} is not a list of names")
    return value

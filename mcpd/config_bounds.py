"""The range of each number in the configuration, declared on its field beside its default
(`bounded`) and checked in one way for every section as the loader reads it (`check`): a value
outside is refused naming the key, the value and the range.

Apart from mcpd/config/, as ConfigError is, so that [limits] beside the protocol can declare its
ranges without loading the TOML loader.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mcpd.config_error import ConfigError

# Shared ceilings, each far above any real setting and below what would hang, exhaust or overflow.
MAX_BYTES = 1 << 48          # a byte size: more than a 64-bit machine addresses (48-bit virtual addresses)
MAX_TOKENS = 1 << 24         # a token count: the longest context mcpd takes from a model (architecture.py)
MAX_REQUESTS = 1 << 20       # requests waiting or in flight: each is memory in the scheduler
MAX_DESCRIPTORS = 1 << 20    # connections: Linux's fs.nr_open default, the most descriptors a process holds
MAX_BATCH_WAIT_MS = 10_000.0   # how long a request may be held for others to batch with it
MAX_WAIT_MS = 60_000.0       # a queueing delay worth acting on: clients give up well before a minute
HOUR_S, DAY_S = 3600.0, 86400.0

BOUND = "bound"   # the field metadata key


@dataclass(frozen=True)
class Bound:
    """[low, high], or (low, high] with low_open; with zero_off 0 is taken too (the feature off)
    while a value above 0 must be at least low (a tiny rate or period divides into infinity)."""
    low: float
    high: float
    low_open: bool = False
    zero_off: bool = False

    def holds(self, value: float) -> bool:
        if self.zero_off and value == 0:
            return True
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def __str__(self) -> str:
        interval = f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]"
        return f"0 (off) or {interval}" if self.zero_off else interval


def bounded(default: float, low: float, high: float, *, low_open: bool = False, zero_off: bool = False):
    """A dataclass field of `default` whose values must lie in the Bound of the rest."""
    return dataclasses.field(default=default, metadata={BOUND: Bound(low, high, low_open, zero_off)})


def bound_of(field: dataclasses.Field) -> Bound | None:
    return field.metadata.get(BOUND)


def check(section: str, cls: type, values: dict) -> None:
    """Refuse the first of `values` (a section's keys as read, built) outside its field's bound."""
    for field in dataclasses.fields(cls):
        bound = bound_of(field)
        if bound is not None and field.name in values and not bound.holds(values[field.name]):
            raise ConfigError(f"{section}.{field.name} = {values[field.name]}: must be {bound}")


def _number(value: float) -> str:
    """3600.0 as 3600, 0.001 as 0.001: the range as an operator would write it."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"

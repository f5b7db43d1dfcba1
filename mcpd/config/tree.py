"""`Config`: the whole tree, one field per TOML section, and what follows from several of them."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from mcpd.config.contexts import CacheConfig, ClusterConfig, ContextsConfig, PersistenceConfig
from mcpd.config.engine import EngineConfig, PoolConfig
from mcpd.config.listeners import HttpConfig, MetricsConfig, SecurityConfig, ServerConfig
from mcpd.config.models import LEGACY_NAME, ModelConfig, ModelEntry, RoutingConfig, VersionConfig
from mcpd.config.processes import SupervisorConfig, WorkersConfig
from mcpd.config.scheduler import SchedulerConfig
from mcpd.config.tracing import TracingConfig
from mcpd.protocol.limits import LimitsConfig


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
    tracing: TracingConfig = field(default_factory=TracingConfig)

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

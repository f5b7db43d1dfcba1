"""The daemon's configuration: one frozen dataclass tree, loaded once from TOML and passed down.

Every process receives the same `Config` object (pickled to each child as it starts), so
configuration flows one way: supervisor -> children. Validation happens here, at load time, and
names the offending key and value so an operator can fix the file without reading code.
"""
from __future__ import annotations

from mcpd.config.contexts import CacheConfig, ClusterConfig, ContextsConfig, PersistenceConfig
from mcpd.config.engine import EngineConfig, PoolConfig
from mcpd.config.listeners import HttpConfig, MetricsConfig, SecurityConfig, ServerConfig, is_loopback
from mcpd.config.loader import from_dict, load
from mcpd.config.models import (AUTO_PATH, EMBEDDED_PATH, LEGACY_NAME, ModelConfig, ModelEntry, RoutingConfig,
                                VersionConfig)
from mcpd.config.processes import WAIT_POLICIES, SupervisorConfig, WorkersConfig
from mcpd.config.scheduler import PriorityClass, SchedulerConfig, TenantShare
from mcpd.config.tracing import TracingConfig
from mcpd.config.tree import Config
# Defined apart so that the protocol and the client need not load this package and its TOML loader.
from mcpd.config_error import ConfigError
from mcpd.protocol.limits import LimitsConfig

__all__ = ["AUTO_PATH", "EMBEDDED_PATH", "LEGACY_NAME", "WAIT_POLICIES", "CacheConfig", "ClusterConfig", "Config",
           "ConfigError", "ContextsConfig", "EngineConfig", "HttpConfig", "LimitsConfig", "MetricsConfig",
           "ModelConfig", "ModelEntry", "PersistenceConfig", "PoolConfig", "PriorityClass", "RoutingConfig",
           "SchedulerConfig", "SecurityConfig", "ServerConfig", "SupervisorConfig", "TenantShare", "TracingConfig", "VersionConfig",
           "WorkersConfig", "from_dict", "is_loopback", "load"]

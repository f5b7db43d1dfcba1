"""[tracing]: OpenTelemetry spans of each request across the processes (mcpd/tracing/), off by default."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from mcpd.config_bounds import bounded
from mcpd.config_error import ConfigError

EXPORTERS = ("otlp", "file")


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = False
    # share of requests traced (by trace id); a client's traceparent decides its own
    sample_ratio: float = bounded(1.0, 0, 1)
    exporter: str = "otlp"       # otlp: OTLP/HTTP to `endpoint`; file: one JSON span per line appended to `path`
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    path: str = ""
    service_name: str = "mcpd"

    def check(self) -> None:
        if self.exporter not in EXPORTERS:
            raise ConfigError(f"tracing.exporter = {self.exporter!r}: use {' or '.join(EXPORTERS)}")
        if not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"tracing.endpoint = {self.endpoint!r}: must be an http:// or https:// URL")
        if not self.service_name:
            raise ConfigError("tracing.service_name must not be empty")
        if not self.enabled:
            return
        if self.exporter == "file" and not self.path.startswith("/"):
            raise ConfigError(f"tracing.path = {self.path!r}: the file exporter needs an absolute path")
        # Each process would fail at its start and restart forever: say it once, here.
        needed = ["opentelemetry.sdk"] + (["opentelemetry.exporter.otlp.proto.http"] if self.exporter == "otlp" else [])
        if any(importlib.util.find_spec(module) is None for module in needed):
            raise ConfigError(f"tracing.enabled = true with the {self.exporter} exporter needs {', '.join(needed)}: "
                              "pip install 'mcpd[tracing]'")

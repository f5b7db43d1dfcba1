"""The error a configuration file or value raises, apart from mcpd/config/ so that the protocol's
limits can raise it without loading the TOML loader."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration file or value that mcpd cannot run with."""

"""Live reload inside a child: take a Reload message, apply what this process can change while
running, and confirm to the supervisor which keys that was.

Every process applies `server.log_level`; the scheduler also hands the config to its
`apply_config` when it has one (it reports which scheduling keys it took). Anything not
confirmed by some process needs a restart, and `mcpctl reload` says so.
"""
from __future__ import annotations

import logging

from mcpd.config import Config
from mcpd.daemon import messages
from mcpd.daemon.child import EventReporter

EVERY_PROCESS = ("server.log_level",)


def apply_log_level(config: Config) -> list[str]:
    logging.getLogger().setLevel(config.server.log_level.upper())
    return list(EVERY_PROCESS)


def apply(reload: messages.Reload, events: EventReporter) -> Config:
    """What the front-end and the workers do with a Reload: the log level, then confirm."""
    events.send(messages.Reloaded, reload.token, apply_log_level(reload.config))
    return reload.config

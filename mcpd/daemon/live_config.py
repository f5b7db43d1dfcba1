"""Live reload inside a child: take a RELOAD message, apply what this process can change while
running, and confirm to the supervisor which keys that was.

Every process applies `server.log_level`; the scheduler also hands the config to its
`apply_config` when it has one (it reports which scheduling keys it took). Anything not
confirmed by some process needs a restart, and `mcpctl reload` says so.
"""
from __future__ import annotations

import logging

import msgpack

from mcpd import config as config_module
from mcpd.config import Config
from mcpd.daemon.child import EventReporter

EVERY_PROCESS = ("server.log_level",)


def decode(frames: list[bytes]) -> tuple[int, Config]:
    """(token, config) from [RELOAD, msgpack {"token", "config"}]."""
    message = msgpack.unpackb(frames[1], raw=False)
    return message["token"], config_module.from_dict(message["config"])


def apply_log_level(config: Config) -> list[str]:
    logging.getLogger().setLevel(config.server.log_level.upper())
    return list(EVERY_PROCESS)


def apply(frames: list[bytes], events: EventReporter) -> Config:
    """What the front-end and the workers do with a RELOAD: the log level, then confirm."""
    token, config = decode(frames)
    events.send("reloaded", token=token, applied=apply_log_level(config))
    return config

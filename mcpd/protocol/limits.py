"""[limits]: what one request may hold, the part of the configuration the protocol itself checks.

It lives beside the protocol, not in mcpd/config/, so that the client library, which parses
replies with the same wire code, never loads the daemon's TOML loader.
"""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.config_error import ConfigError


@dataclass(frozen=True)
class LimitsConfig:
    max_message_bytes: int = 64 << 20  # all frames of one request together (also ZMQ MAXMSGSIZE)
    max_header_bytes: int = 1 << 20    # the msgpack header frame (a max_prompt_tokens prompt fits)
    max_frames: int = 16               # frames in one request, header included
    max_prompt_tokens: int = 32768
    max_new_tokens: int = 2048
    max_stream_chunks_per_s: float = 200.0   # per stream; faster output is merged into fewer chunks
    max_client_backlog_bytes: int = 64 << 20  # replies waiting for one client that does not read
    max_incoming_bytes: int = 256 << 20       # unfinished requests of all TCP clients together
    max_connections_per_address: int = 256    # TCP connections one client address holds open
    max_tensor_elements: int = 1 << 24        # elements of one infer input (its shape's product)

    def check(self) -> None:
        for name in ("max_message_bytes", "max_header_bytes", "max_frames", "max_prompt_tokens",
                     "max_new_tokens", "max_stream_chunks_per_s", "max_client_backlog_bytes",
                     "max_incoming_bytes", "max_connections_per_address", "max_tensor_elements"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"limits.{name} = {getattr(self, name)}: must be positive")
        if self.max_header_bytes > self.max_message_bytes:
            raise ConfigError("limits.max_header_bytes must not exceed limits.max_message_bytes")

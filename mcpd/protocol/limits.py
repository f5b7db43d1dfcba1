"""[limits]: what one request may hold, the part of the configuration the protocol itself checks.

It lives beside the protocol, not in mcpd/config/, so that the client library, which parses
replies with the same wire code, never loads the daemon's TOML loader.
"""
from __future__ import annotations

from dataclasses import dataclass

from mcpd.config_bounds import MAX_BYTES, MAX_DESCRIPTORS, MAX_TOKENS, bounded
from mcpd.config_error import ConfigError

MAX_FRAMES = 1024   # a header and its infer inputs, one frame each


@dataclass(frozen=True)
class LimitsConfig:
    max_message_bytes: int = bounded(64 << 20, 1, MAX_BYTES)   # all frames of one request together (also ZMQ MAXMSGSIZE)
    max_header_bytes: int = bounded(1 << 20, 1, MAX_BYTES)     # the msgpack header frame (a max_prompt_tokens prompt fits)
    max_frames: int = bounded(16, 1, MAX_FRAMES)               # frames in one request, header included
    max_prompt_tokens: int = bounded(32768, 1, MAX_TOKENS)
    max_new_tokens: int = bounded(2048, 1, MAX_TOKENS)
    # per stream; faster output is merged into fewer chunks (1/rate is the wait: a tiny rate is never)
    max_stream_chunks_per_s: float = bounded(200.0, 0.1, 1e6)
    max_client_backlog_bytes: int = bounded(64 << 20, 1, MAX_BYTES)   # replies waiting for one client that does not read
    max_incoming_bytes: int = bounded(256 << 20, 1, MAX_BYTES)        # unfinished requests of all TCP clients together
    max_connections_per_address: int = bounded(256, 1, MAX_DESCRIPTORS)   # TCP connections one client address holds open
    # elements of one infer input (its shape's product), each a byte at least
    max_tensor_elements: int = bounded(1 << 24, 1, MAX_BYTES)

    def check(self) -> None:
        if self.max_header_bytes > self.max_message_bytes:
            raise ConfigError("limits.max_header_bytes must not exceed limits.max_message_bytes")

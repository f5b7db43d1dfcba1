"""Where the daemon listens (ZeroMQ, HTTP, metrics) and who may reach it: [server], [security],
[http], [metrics]."""
from __future__ import annotations

import grp
from dataclasses import dataclass

from mcpd.config_bounds import HOUR_S, MAX_BYTES, MAX_DESCRIPTORS, bounded
from mcpd.config_error import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    tcp: str = "tcp://127.0.0.1:7070"   # client endpoint; "" disables TCP (ipc stays)
    runtime_dir: str = ""               # sockets + lock; "" = $RUNTIME_DIRECTORY, else per-user tmp
    state_dir: str = ""                 # persistent state; "" = $STATE_DIRECTORY, else ~/.local/state
    log_level: str = "info"

    def check(self) -> None:
        if self.tcp and not self.tcp.startswith("tcp://"):
            raise ConfigError(f"server.tcp = {self.tcp!r}: must start with tcp:// or be empty")
        if self.tcp:   # ZeroMQ binds port 99999 as 34463: a port past 65535 is refused, not wrapped
            listen_host("server.tcp", self.tcp, "tcp://127.0.0.1:7070")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"server.log_level = {self.log_level!r}: use debug, info, warning or error")


def listen_host(key: str, listen: str, example: str) -> str:
    """The host of a host:port listen address (or tcp://host:port endpoint: the host keeps its
    prefix); ConfigError naming `key` if it is not one (the port in ASCII digits: int() takes
    any script's)."""
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
        host = listen_host("metrics.listen", self.listen, "127.0.0.1:9464")
        if not self.allow_remote and host.strip("[]") not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError(f"metrics.listen = {self.listen!r}: not a loopback address; "
                              "set metrics.allow_remote = true to expose metrics beyond this host")


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP listener (mcpd/http/), in the front-end when listen is set."""
    listen: str = ""                   # host:port; "" = off
    auth: str = "auto"                 # auto (API keys unless listen is loopback and CURVE off), on, off
    max_body_bytes: int = bounded(4 << 20, 1, MAX_BYTES)   # a request body over this: 413 before anything is parsed
    body_timeout_s: float = bounded(30.0, 0, HOUR_S, low_open=True)   # a body still arriving after this: 408 (slow senders)
    # an idle keep-alive connection is closed after this
    keepalive_timeout_s: float = bounded(15.0, 0, HOUR_S, low_open=True)
    # open HTTP connections; never more than half the front-end's descriptors
    max_connections: int = bounded(4096, 1, MAX_DESCRIPTORS)
    model_name: str = ""               # the id /v1/models shows; "" = the model's own name

    def check(self) -> None:
        if not self.listen:
            return
        listen_host("http.listen", self.listen, "127.0.0.1:8000")
        if self.auth not in ("auto", "on", "off"):
            raise ConfigError(f"http.auth = {self.auth!r}: use auto, on or off")
        if self.auth == "off" and not self.loopback:
            raise ConfigError(f"http.listen = {self.listen!r} is not a loopback address and http.auth = 'off': "
                              "anyone who can reach it could use the daemon. Use http.auth = 'auto' or 'on' "
                              "with keys from `mcpctl keys api-add`, or bind loopback")

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

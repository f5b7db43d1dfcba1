"""Where the cluster's Redis is, from cluster.redis: one server, a Redis Cluster, or a primary
that Redis Sentinel watches (docs/CLUSTER.md).

    redis://host:port/db, rediss://..., unix://path     one server (the client library's own forms)
    redis+cluster://[user:password@]host:port,host:port  any nodes of a Redis Cluster; the client finds
    rediss+cluster://...                                 the rest (TLS with rediss); db 0, Cluster's only
    redis+sentinel://[user:password@]host:port,host:port/service[/db]
                                                         the sentinels, and the name they know the primary by

The user and password are the data nodes' (the sentinels are asked without). The config check
parses it too, so a malformed URL stops the daemon at start, before any client sees it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote

SERVER_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEME = "redis+sentinel"
MAX_HOSTS = 64
MAX_DB = 15   # Redis's default `databases` is 16


@dataclass(frozen=True)
class RedisURL:
    kind: str   # "server", "cluster" or "sentinel"
    url: str
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""   # the sentinels' name for the primary
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = None


def parse(url: str) -> RedisURL:
    """The URL's parts; ValueError saying what is wrong with it."""
    scheme, separator, rest = url.partition("://")
    if not separator or not url.isprintable():
        raise ValueError("not a URL")
    if scheme in SERVER_SCHEMES:
        return RedisURL("server", url)
    if scheme not in (*CLUSTER_SCHEMES, SENTINEL_SCHEME):
        raise ValueError(f"unknown scheme {scheme!r}")
    userinfo, _, rest = rest.rpartition("@")
    username, _, password = userinfo.partition(":")
    credentials = {"username": unquote(username) or None, "password": unquote(password) or None}
    netloc, _, path = rest.partition("/")
    hosts = tuple(_host_port(part) for part in netloc.split(","))
    if len(hosts) > MAX_HOSTS:
        raise ValueError(f"more than {MAX_HOSTS} hosts")
    if scheme in CLUSTER_SCHEMES:
        if path:
            raise ValueError("a Redis Cluster URL names no database (Cluster has only db 0)")
        return RedisURL("cluster", url, hosts, tls=scheme == "rediss+cluster", **credentials)
    service, _, db = path.partition("/")
    if not service:
        raise ValueError("a Sentinel URL names the primary's service after the hosts: /service[/db]")
    if db and not (db.isdigit() and int(db) <= MAX_DB):
        raise ValueError(f"database {db!r} is not a number from 0 to {MAX_DB}")
    return RedisURL("sentinel", url, hosts, unquote(service), int(db or 0), **credentials)


def _host_port(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):   # an IPv6 address
        host = host[1:-1]
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port)


def redacted(url: str) -> str:
    """The URL as a log line may show it: its password, in the user part or the query, replaced."""
    url = re.sub(r"(://[^/:]*:)[^/]*@", r"\1***@", url)   # the password runs to the last @, as parse() reads it
    return re.sub(r"(password=)[^&]*", r"\1***", url)

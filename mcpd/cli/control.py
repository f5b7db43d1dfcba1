"""How mcpctl reaches the daemon: find its runtime directory, call an op on the control socket.

Exit codes (every command): 0 done (status: healthy), 1 failed (status: unhealthy; the daemon
refused the op; the runtime dir is not safe to talk to), 2 usage error, 3 daemon not reachable,
4 timed out waiting (--wait).

Before it sends anything, mcpctl checks the runtime dir as the daemon does (trusted_path.py):
an op such as `keys allow` must never go to a control socket someone else planted, e.g. in a
/tmp/mcpd-<uid> that another user made first.
"""
from __future__ import annotations

import argparse
import os
import socket
import stat
import sys
import time
from pathlib import Path

import zmq

from mcpd import config as config_module, sockets
from mcpd.client.replies import result_of
from mcpd.protocol import control_ops, wire
from mcpd.security.trusted_path import check_placed_by_trusted_user

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_TIMEOUT = 0, 1, 2, 3, 4
SYSTEM_RUNTIME_DIR = Path("/run/mcpd")
CALL_TIMEOUT_S = 5.0      # one quick op, when --timeout is not given
WAIT_TIMEOUT_S = 120.0    # --wait operations (drain, reload, restart), when --timeout is not given
POLL_S = 0.5


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 86400.0   # --timeout: zmq's poll takes milliseconds as a C long


def seconds_in(low: float, high: float):
    """An argparse type: a number of seconds from `low` to `high` (nan, inf and words refused)."""
    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not low <= value <= high:   # also refuses nan
            raise argparse.ArgumentTypeError(f"{text!r}: give seconds from {low:g} to {high:g}")
        return value
    return seconds


class Unreachable(Exception):
    pass


class TimedOut(Exception):
    pass


def find_runtime_dir(args) -> Path:
    """--runtime-dir, then $MCPD_RUNTIME_DIR, then the config's, then the systemd unit's /run/mcpd."""
    explicit = args.runtime_dir or os.environ.get("MCPD_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    configured = config_module.load(args.config).runtime_dir
    if not (configured / sockets.CONTROL_IPC).exists() and (SYSTEM_RUNTIME_DIR / sockets.CONTROL_IPC).exists():
        return SYSTEM_RUNTIME_DIR
    return configured


def call(args, op: str, op_args: dict | None = None, timeout_s: float | None = None) -> dict:
    """One control op on the daemon mcpctl's arguments name; see call_at."""
    timeout_s = timeout_s if timeout_s is not None else (args.timeout or CALL_TIMEOUT_S)
    return call_at(find_runtime_dir(args), op, op_args, timeout_s)


def call_at(runtime_dir: Path, op: str, op_args: dict | None = None, timeout_s: float = CALL_TIMEOUT_S) -> dict:
    """One control op; its result, or MCPDError with the daemon's code. The op and its args are
    checked against the control-op table before anything is sent (BAD_REQUEST, UNKNOWN_OP)."""
    control_ops.find(op).decode_args(op_args or {})
    if not (runtime_dir / sockets.CONTROL_IPC).exists():
        raise Unreachable(f"no control socket at {runtime_dir / sockets.CONTROL_IPC}: is mcpd running?")
    check_placed_by_trusted_user(runtime_dir)
    check_listening(runtime_dir / sockets.CONTROL_IPC)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(sockets.control_endpoint(runtime_dir))
        sock.send(wire.encode_request(op, 1, op_args or {}))
        if not sock.poll(timeout_s * 1000):
            raise Unreachable(f"mcpd did not answer on {runtime_dir / sockets.CONTROL_IPC} within {timeout_s:g}s")
        return result_of(wire.decode_reply(sock.recv()))
    finally:
        sock.close(0)
        context.term()


def check_listening(path: Path) -> None:
    """Unreachable at once where nothing can be reached at the socket's path: a daemon killed
    without its clean stop leaves the file behind, and ZeroMQ would retry it in silence until
    the call's time ran out. A path that is no socket (a directory, a link to a device) is named so."""
    if not stat.S_ISSOCK(os.stat(path).st_mode):
        raise Unreachable(f"{path} is not a socket: not mcpd's control socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            raise Unreachable(f"nothing listens on {path} (left by a daemon that did not stop cleanly): "
                              f"is mcpd running?") from None
        except OSError as e:
            raise Unreachable(f"cannot connect to {path}: {e.strerror}") from None


def wait_for(args, what: str, check) -> None:
    """Poll `status` until check(status) returns None (done), printing its progress line (a
    string) to stderr meanwhile; TimedOut after --timeout (default WAIT_TIMEOUT_S)."""
    deadline = time.monotonic() + wait_timeout(args)
    shown = None
    while True:
        progress = check(call(args, "status"))
        if progress is None:
            return
        if progress != shown:
            print(f"mcpctl: {what}: {progress}", file=sys.stderr)
            shown = progress
        if time.monotonic() >= deadline:
            raise TimedOut(f"{what}: still {progress} after {wait_timeout(args):g}s")
        time.sleep(POLL_S)


def wait_timeout(args) -> float:
    return args.timeout or WAIT_TIMEOUT_S

"""Why mcpd will not start, and the exit status that tells the operator (and systemd) so.

A refusal is final: starting again, or restarting a child, would meet the same obstacle, so the
supervisor exits with the reason on stderr instead of retrying. The statuses are stable and
documented in README.md ("Start-up refusals"):

    1  IN_USE       another mcpd holds the runtime dir or the state dir, or the tcp port is taken
    2  CONFIG       the configuration does not validate, or names something that cannot be used
                    (an address not on this host, a port this user may not bind, a dir it cannot make)
    3  UNSAFE_PATH  a directory or file the daemon would use could be changed by another user
                    (owned by someone else, writable by others, or a link where a file must be)
"""
from __future__ import annotations

IN_USE, CONFIG, UNSAFE_PATH = 1, 2, 3


class StartRefused(RuntimeError):
    """The daemon cannot start; the message says why and what to change."""
    exit_status = CONFIG


class InUse(StartRefused):
    exit_status = IN_USE


class UnsafePath(StartRefused):
    exit_status = UNSAFE_PATH


def by_status(status: int) -> type[StartRefused]:
    """The refusal class of an exit status (a child reports the status, the supervisor re-raises)."""
    return {IN_USE: InUse, UNSAFE_PATH: UnsafePath}.get(status, StartRefused)

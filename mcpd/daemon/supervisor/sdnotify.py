"""systemd's notify protocol in pure Python: one datagram per message to $NOTIFY_SOCKET."""
from __future__ import annotations

import os
import socket


class SystemdNotifier:
    def __init__(self, address: str | None = None):
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):   # abstract namespace socket
            address = "\0" + address[1:]
        self.address = address or None
        self.watchdog_interval_s = self._watchdog_interval()

    @staticmethod
    def _watchdog_interval() -> float | None:
        # systemd asks for a ping at least every WATCHDOG_USEC; ping twice as often, and only if
        # the variable is meant for this process.
        usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
        if not usec or (pid and int(pid) != os.getpid()):
            return None
        return int(usec) / 2e6

    def notify(self, **fields: str | int) -> None:
        """notify(READY=1, STATUS="...") sends "READY=1\\nSTATUS=...". No-op outside systemd."""
        if not self.address:
            return
        message = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(message, self.address)
            except OSError:
                pass  # systemd gone or socket unreachable: notification is best effort

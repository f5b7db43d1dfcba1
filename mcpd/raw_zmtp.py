"""A ZeroMQ peer written by hand over a plain TCP socket, for tests and benchmarks that play an
attacker: ZMTP 3.0 with the NULL mechanism (RFC 23), as a DEALER.

libzmq never puts part of a multipart message on the wire (it sends a message only once its last
frame is queued), so a client that trickles a huge message, or begins one and never ends it, has
to speak the protocol itself. This one does, and nothing more: it is not a client for real use.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)


def frame_header(size: int, flags: int = 0) -> bytes:
    if size > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", size)
    return bytes([flags, size])


class RawPeer:
    def __init__(self, host: str, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.sendall(GREETING)
        self._read_exactly(64)   # the daemon's greeting
        ready = b"\x05READY" + _property(b"Socket-Type", b"DEALER")
        self.sock.sendall(frame_header(len(ready), COMMAND) + ready)
        self._read_frame()       # the daemon's READY

    def begin_frame(self, size: int, more: bool) -> None:
        """Announce a frame of `size` bytes; its body follows with send_raw (as slowly as you like)."""
        self.sock.sendall(frame_header(size, MORE if more else 0))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_unfinished(self, frames: int, frame_bytes: int, piece: bytes, pause_s: float = 0.0) -> bool:
        """Send `frames` frames of a message that never ends (each marked "more"), `piece` at a
        time with a pause after each; True if the daemon cut the connection meanwhile."""
        try:
            for _ in range(frames):
                self.begin_frame(frame_bytes, more=True)
                for start in range(0, frame_bytes, len(piece)):
                    self.send_raw(piece[:frame_bytes - start])
                    time.sleep(pause_s)
            return False
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()

    def _read_frame(self) -> tuple[int, bytes]:
        flags = self._read_exactly(1)[0]
        size = struct.unpack(">Q", self._read_exactly(8))[0] if flags & LONG else self._read_exactly(1)[0]
        return flags, self._read_exactly(size)

    def _read_exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            got = self.sock.recv(n - len(data))
            if not got:
                raise ConnectionError("the daemon closed the connection")
            data += got
        return data


def at_lowest_priority(send: Callable[[], T]) -> T:
    """Run `send` on a thread of its own at nice 19 and return what it returns. A remote sender
    costs the daemon's machine no CPU; a local one sending at full speed takes a core that the
    front-end's checks then wait for on a 2-core machine, which tests the kernel's scheduler, not
    the daemon."""
    result: list = []

    def body() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        result.append(send())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if not result:
        raise RuntimeError("the sender failed (its traceback is above)")
    return result[0]


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

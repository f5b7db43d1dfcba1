"""The HTTP listener's accepts (mcpd/http/acceptor.py) in-process, on uvloop and real sockets:
out of descriptors, it stops watching the listening socket instead of failing accepts in a loop,
and takes the waiting connection once descriptors are back."""
import asyncio
import logging
import os
import resource
import socket

import uvloop

from mcpd.http import acceptor
from mcpd.http.acceptor import Acceptor


async def until(predicate, timeout_s: float = 10) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError


def lowest_free_descriptor() -> int:
    fd = os.dup(0)
    os.close(fd)
    return fd


async def out_of_descriptors_then_back() -> None:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    accepts = Acceptor(listener, lambda sock, address: accepted.append((sock, address)), logging.getLogger("test"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    client = socket.socket()
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_descriptor(), hard))   # no new descriptor
        client.connect(listener.getsockname())   # done by the kernel: it waits in the backlog
        accepts.start()
        await until(lambda: accepts.pauses == 1)
        assert accepted == []
        assert not loop.remove_reader(listener.fileno())   # paused: the loop no longer wakes for it
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await until(lambda: accepted)                      # after the pause, the waiting one is taken
        assert accepted[0][1] == "127.0.0.1" and accepts.pauses == 1
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for sock, _ in accepted:
            sock.close()
        client.close()
        accepts.close()


def test_accepts_pause_while_descriptors_run_out_and_resume(monkeypatch):
    monkeypatch.setattr(acceptor, "PAUSE_S", 0.2)
    uvloop.run(out_of_descriptors_then_back())

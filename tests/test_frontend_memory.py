"""What a peer can make the front-end hold before a request exists (issue 13): a huge multipart
message and many half-sent ones are cut off once they pass their limits, measured on the
front-end's resident memory. The peers speak ZMTP by hand (mcpd.raw_zmtp): libzmq itself never
sends part of a message."""
import threading
import time
from pathlib import Path

import pytest

from mcpd.raw_zmtp import RawPeer, at_lowest_priority

MiB = 1 << 20
MESSAGE_LIMIT, INCOMING_LIMIT = 4 * MiB, 8 * MiB


@pytest.fixture(scope="module")
def d(module_daemon):
    return module_daemon(limits={"max_message_bytes": MESSAGE_LIMIT, "max_header_bytes": 8192,
                                 "max_incoming_bytes": INCOMING_LIMIT})


class FrontendMemory:
    """The front-end's peak resident size from now on (the kernel's VmHWM, reset here)."""

    def __init__(self, d):
        self.pid = d.pid_of("frontend")
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")   # 5: reset the peak to the current size
        self.start = self._kib("VmRSS")

    def peak_growth(self) -> int:
        return (self._kib("VmHWM") - self.start) * 1024

    def _kib(self, field: str) -> int:
        line = next(x for x in Path(f"/proc/{self.pid}/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1])


def cut_count(d) -> int:
    return d.status()["requests"]["incoming"].get("cut", 0)


def test_one_huge_multipart_message_is_cut_near_its_limit(d):
    memory = FrontendMemory(d)
    peer = RawPeer("127.0.0.1", d.port)
    frame = MESSAGE_LIMIT - 64 * 1024   # each frame passes ZMQ_MAXMSGSIZE; 60 of them are 234 MiB
    assert at_lowest_priority(lambda: peer.send_unfinished(60, frame, b"x" * MiB))
    peer.close()
    growth = memory.peak_growth()
    assert growth < 48 * MiB, f"the front-end grew by {growth / MiB:.0f} MiB"
    d.wait_until(lambda: cut_count(d) >= 1, 10, "the cut counted")
    with d.client() as client:
        assert client.ping()["pong"]


def test_a_sender_part_way_through_a_message_is_cut_near_the_limit_however_fast_it_goes_on(d):
    """A message begun, paused, then rushed on: the front-end looks at a connection as its bytes
    arrive, not when a timer or its own growth says, so the rush gets little past the limit.
    Three senders, one after the other: each meets the front-end at another moment."""
    for _ in range(3):
        memory = FrontendMemory(d)
        before = cut_count(d)
        peer = RawPeer("127.0.0.1", d.port)
        frame = MESSAGE_LIMIT - 64 * 1024
        peer.begin_frame(frame, more=True)
        peer.send_raw(b"x" * (3 * MiB))   # under the limit: held, not cut
        time.sleep(0.6)   # paused: longer than the front-end's periodic checks are apart
        assert cut_count(d) == before
        assert at_lowest_priority(lambda: rush(peer, frame - 3 * MiB, frames=12)), "a 28 MiB message was never cut"
        peer.close()
        growth = memory.peak_growth()
        assert growth < MESSAGE_LIMIT + 6 * MiB, f"the front-end grew by {growth / MiB:.1f} MiB"
        d.wait_until(lambda: cut_count(d) == before + 1, 10, "the cut counted")
    with d.client() as client:
        assert client.ping()["pong"]


def rush(peer: RawPeer, rest_of_frame: int, frames: int) -> bool:
    """The rest of the open frame, then `frames` frames of 2 MiB, half a MiB a millisecond; True
    once the daemon cuts the connection."""
    try:
        peer.send_raw(b"x" * rest_of_frame)
        for _ in range(frames):
            peer.begin_frame(2 * MiB, more=True)
            for _ in range(4):
                peer.send_raw(b"x" * (MiB // 2))
                time.sleep(0.001)
        return False
    except OSError:
        return True


def test_many_slow_senders_hold_no_more_than_the_incoming_limit(d):
    memory = FrontendMemory(d)
    before = cut_count(d)
    peers = [RawPeer("127.0.0.1", d.port) for _ in range(16)]
    cut = [False] * len(peers)

    def trickle(i: int) -> None:   # 3.5 MiB of a frame that never ends, 64 KiB every 50 ms
        cut[i] = peers[i].send_unfinished(1, 3 * MiB + MiB // 2, b"y" * (64 * 1024), 0.05)

    threads = [threading.Thread(target=trickle, args=(i,)) for i in range(len(peers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    growth = memory.peak_growth()   # 16 x 3.5 = 56 MiB if all were held
    assert growth < 32 * MiB, f"the front-end grew by {growth / MiB:.0f} MiB"
    assert sum(cut) >= 10 and cut_count(d) - before == sum(cut)
    for peer in peers:
        peer.close()
    with d.client() as client:
        context = client.context("still-takes-big-updates")
        context["blob"] = bytes(3 * MiB)   # one whole request near the limit still goes through
        context.sync()

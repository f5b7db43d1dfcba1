"""A damaged journal, an unusable one, and a full disk under the real daemon (issue 13).

- A flipped bit in the journal costs the versions of that one context after it; one in the
  snapshot costs that one context; the log names them and the damaged files are kept.
- A journal written under a larger contexts.max_field_bytes, and a directory where the journal
  should be, let the daemon start at once (before: the scheduler restarted in a loop).
- A full disk answers STORAGE_FULL with retry_after_ms, the context stays at its previous
  version in memory, in the host cache and on disk, the daemon carries on, and the same update
  passes once there is room. The disk is a 1 MiB tmpfs mounted over the journal's directory
  when this process may mount (root, as in CI); otherwise the scheduler's file size is capped
  with prlimit (RLIMIT_FSIZE), which the kernel enforces at the same write (EFBIG, not ENOSPC).
"""
import os
import re
import resource
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mcpd.client import Client
from mcpd.contexts import journal_file
from mcpd.protocol import codes
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError
from mcpd.testing import Daemon, toml_text

pytestmark = pytest.mark.slow   # each test starts a daemon and damages its storage

IDS = ("ctx-a", "ctx-b", "ctx-c", "ctx-d")
ROUNDS = 30   # 4 opens and 120 commits: 124 records


def update(client: Client, context_id: str, base: int, **fields) -> int:
    entries, frames = codec.to_wire([codec.diff(name, None, value) for name, value in fields.items()])
    result, _ = client.call_with_payload("context.update", {"id": context_id, "base": base, "changes": entries},
                                         frames)
    return result["version"]


def version_of(client: Client, context_id: str) -> int:
    return client.call("context.get", {"id": context_id, "since": 0})["version"]


def record_offsets(path: Path) -> list[int]:
    """Where each record of a journal file begins (format 2, or format 1 before issue 13)."""
    data = path.read_bytes()
    v2 = data.startswith(journal_file.FILE_MAGIC)
    header = journal_file.HEADER if v2 else journal_file.V1_HEADER
    offsets, at = [], len(journal_file.FILE_MAGIC) if v2 else 0
    while at < len(data):
        offsets.append(at)
        length = header.unpack_from(data, at)[1 if v2 else 0]
        at += header.size + length
    return offsets


def flip_bit(path: Path, offset: int) -> bytes:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(data)
    return bytes(data)


def restarts(d: Daemon, role: str) -> int:
    return next(p["restarts"] for p in d.processes() if p["role"] == role)


def test_a_damaged_journal_costs_only_the_damaged_contexts_versions(fresh_daemon):
    d = fresh_daemon()
    with d.client() as client:
        for context_id in IDS:
            client.call("context.open", {"id": context_id})
        for step in range(ROUNDS):
            for context_id in IDS:
                update(client, context_id, step, n=step)
    d.stop()
    journal = d.root / "state" / "contexts" / "journal-0.log"
    damaged = flip_bit(journal, record_offsets(journal)[11] + 30)   # record 12 of 124: ctx-d's version 2
    d.start()
    with d.client() as client:
        for context_id in IDS[:3]:
            assert version_of(client, context_id) == ROUNDS
        assert version_of(client, "ctx-d") == 1
        assert f"default/ctx-d versions 2-{ROUNDS} lost (restored at version 1)" in d.log()
        kept, = (d.root / "state").glob("contexts.damaged-*/journal-0.log")
        assert kept.read_bytes() == damaged
        assert d.status()["contexts"]["persistence"]["damaged_bytes"] > 0
        for context_id in IDS:   # two more versions of each, after the clean snapshot
            base = version_of(client, context_id)
            update(client, context_id, base, n=100)
            update(client, context_id, base + 1, n=101)
    d.stop()
    snapshot = d.root / "state" / "contexts" / "snapshot"
    flip_bit(snapshot, snapshot.read_bytes().index(b"ctx-b") + 2)
    d.start()
    with d.client() as client:
        assert [version_of(client, c) for c in ("ctx-a", "ctx-c", "ctx-d")] == [ROUNDS + 2, ROUNDS + 2, 3]
        with pytest.raises(MCPDError) as raised:
            version_of(client, "ctx-b")
        assert raised.value.code == codes.NOT_FOUND
    assert f"default/ctx-b versions {ROUNDS + 1}-{ROUNDS + 2} lost (not restored)" in d.log()


def start_within(d: Daemon, seconds: float) -> None:
    d.start(wait=False)
    d.wait_for_notification("READY=1", seconds)


def test_a_journal_the_scheduler_cannot_use_never_makes_it_restart(fresh_daemon):
    d = fresh_daemon()
    field = np.arange(16384, dtype=np.float32)   # 64 KiB
    with d.client() as client:
        client.call("context.open", {"id": "big"})
        update(client, "big", 0, w=field)
    d.stop()
    sections = {"server": {"tcp": d.endpoint, "runtime_dir": str(d.runtime_dir), "state_dir": str(d.root / "state")},
                "workers": {"count": 1, "device": "cpu"}, "engine": {"pool_bytes": 64 << 20},
                "contexts": {"max_field_bytes": 1024}}
    d.config_path.write_text(toml_text(sections))   # a smaller field limit than the journal was written under
    start_within(d, 60)
    with d.client() as client:
        assert version_of(client, "big") == 1
        got, frames = client.call_with_payload("context.get", {"id": "big", "since": 0})
        w, = [c for c in codec.from_wire(got["changes"], frames, codec.DeltaLimits(1 << 20)) if c.name == "w"]
        assert codec.apply(None, w, codec.DeltaLimits(1 << 20)).tobytes() == field.tobytes()
    assert restarts(d, "scheduler") == 0
    d.stop()
    journal, = (d.root / "state" / "contexts").glob("journal-*.log")
    journal.rename(d.root / "journal-by-hand")
    journal.mkdir()   # an operator's mistake: a directory where the journal should be
    start_within(d, 60)
    with d.client() as client:
        client.call("context.open", {"id": "after"})
        update(client, "after", 0, note="journaled")
    assert restarts(d, "scheduler") == 0
    assert re.search(rf"{journal.name} is not a regular file \(dir\): moved aside", d.log())
    assert list((d.root / "state").glob(f"contexts.damaged-*/{journal.name}"))
    d.stop()
    d.start()
    with d.client() as client:
        assert version_of(client, "after") == 1


class SmallDisk:
    """The journal's directory on a disk we can fill and empty while the daemon runs."""

    def __init__(self, d: Daemon):
        self.d, self.path = d, d.root / "state" / "contexts"
        self.path.mkdir(parents=True, mode=0o700)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(self.path)],
                              capture_output=True)
        self.mounted = done.returncode == 0   # else: not allowed to mount here, cap the file size instead

    def fill(self, leave: int) -> None:
        """Leave `leave` bytes for the journal to grow into."""
        if self.mounted:
            free = os.statvfs(self.path).f_bavail * os.statvfs(self.path).f_frsize
            with open(self.path / f"filler-{free}", "wb") as f:
                f.write(bytes(max(0, free - leave)))
        else:
            size = os.stat(self.path / f"journal-{self.d.status()['contexts']['persistence']['generation']}.log").st_size
            resource.prlimit(self.d.pid_of("scheduler"), resource.RLIMIT_FSIZE, (size + leave, resource.RLIM_INFINITY))

    def empty(self) -> None:
        if self.mounted:
            for filler in self.path.glob("filler-*"):
                filler.unlink()
        else:
            resource.prlimit(self.d.pid_of("scheduler"), resource.RLIMIT_FSIZE,
                             (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    def remove(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.path)], check=True)


@pytest.fixture
def daemon_on_small_disk(fresh_daemon):
    d = fresh_daemon(started=False)
    disk = SmallDisk(d)
    try:
        yield d.start(), disk
    finally:
        d.stop()   # before the disk goes; fresh_daemon removes its directory after
        disk.remove()


def noise(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()


def storage_full(call) -> MCPDError:
    with pytest.raises(MCPDError) as raised:
        call()
    assert raised.value.code == codes.STORAGE_FULL and raised.value.retry_after_ms == 1000, raised.value
    return raised.value


def test_a_full_disk_answers_storage_full_and_loses_nothing(daemon_on_small_disk):
    d, disk = daemon_on_small_disk
    with d.client(timeout=120) as client:
        client.call("context.open", {"id": "log"})
        chat = client.context("chat")
        chat.generate("Hello", max_tokens=4, temperature=0)
        disk.fill(leave=200 << 10)
        version, refused = 0, None
        while refused is None:
            try:
                version = update(client, "log", version, blob=noise(64 << 10, version))
            except MCPDError as e:
                refused = e
        assert refused.code == codes.STORAGE_FULL and refused.retry_after_ms == 1000, refused
        assert 1 <= version < 4
        disk.fill(leave=0)
        for pad in range(100):   # the file's last page may still take a few small records
            try:
                client.call("context.open", {"id": f"pad{pad}"})   # the smallest record there is
            except MCPDError as e:
                assert e.code == codes.STORAGE_FULL
                break
        storage_full(lambda: update(client, "log", version, blob=noise(64 << 10, version)))
        storage_full(lambda: chat.generate(" again", max_tokens=4, temperature=0))
        storage_full(lambda: client.call("context.open", {"id": "new"}))
        assert client.ping() and client.generate("still serving", max_tokens=2).completion_tokens == 2
        assert version_of(client, "log") == version and version_of(client, "chat") == 1   # in memory
    kill_scheduler(d)
    with d.client(timeout=120) as client:   # the restarted scheduler took them from the cache and the disk
        assert version_of(client, "log") == version and version_of(client, "chat") == 1
        disk.empty()
        assert update(client, "log", version, blob=noise(64 << 10, version)) == version + 1   # room again
    d.stop()
    d.start()
    with d.client() as client:
        got, frames = client.call_with_payload("context.get", {"id": "log", "since": version})
        blob, = codec.from_wire(got["changes"], frames, codec.DeltaLimits(1 << 20))
        assert got["version"] == version + 1 and codec.apply(None, blob, codec.DeltaLimits(1 << 20)) == \
            noise(64 << 10, version)
        assert version_of(client, "chat") == 1


def kill_scheduler(d: Daemon) -> None:
    old = d.pid_of("scheduler")
    os.kill(old, signal.SIGKILL)
    d.wait_until(lambda: d.pid_of("scheduler") not in (None, old) and d.status()["state"] == "ready", 120,
                 "scheduler restarted")
    with d.client() as client:
        d.wait_until(lambda: all(w["ready"] for w in client.status()["workers"]), 60, "workers known again")


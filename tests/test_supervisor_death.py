"""The supervisor dying (SIGKILL, no chance to clean up) takes every child with it, and what it
could not clean up (its host cache segment in /dev/shm) is reclaimed: by its next start on the
same runtime dir, and by the test's cleanup. The fork server the children come from
(supervisor/launcher.py) lives and dies with the supervisor and takes them along."""
import os
import pathlib
import shutil
import signal
import socket
import tempfile
import time

import psutil

import pytest

from mcpd.cli import control
from mcpd.daemon.supervisor.launcher import keep_fork_server_in
from mcpd.memory import host_segment, pool_segment

pytestmark = pytest.mark.slow   # each test starts a daemon and kills its supervisor


def exited(process: psutil.Process) -> bool:
    """Dead, reaped or not: an orphan stays a zombie until the init process reaps it, which
    some container inits do only every second or so (psutil.wait_procs waits for the reaping,
    1.4 s a kill here, where the children had exited within 30 ms)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def gone(pid: int) -> bool:
    try:
        return exited(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return True


def kill_supervisor(d) -> None:
    children = [psutil.Process(p["pid"]) for p in d.processes() if p["role"] != "supervisor"]
    assert len(children) == 4   # front-end, scheduler, pool keeper, worker
    os.kill(d.process.pid, signal.SIGKILL)
    d.process.wait(10)
    deadline = time.monotonic() + 5
    while not all(exited(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.01)
    alive = [p.pid for p in children if not exited(p)]
    assert not alive, f"children outlived the supervisor: {alive}"


def test_sigkill_supervisor_leaves_no_orphans_and_mcpctl_says_at_once_that_none_listens(fresh_daemon):
    d = fresh_daemon()
    kill_supervisor(d)
    assert (d.runtime_dir / "control.ipc").exists()   # no clean stop removed it
    with pytest.raises(control.Unreachable, match="nothing listens on .*control.ipc"):
        control.call_at(d.runtime_dir, "status", timeout_s=60)


@pytest.mark.parametrize("plant", [os.mkdir, lambda path: os.symlink("/dev/null", path)])
def test_mcpctl_names_a_control_path_that_is_no_socket(tmp_path, plant):
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    plant(runtime_dir / "control.ipc")
    with pytest.raises(control.Unreachable, match="control.ipc is not a socket"):
        control.call_at(runtime_dir, "status", timeout_s=60)


def test_a_killed_daemons_segments_and_fork_server_dir_are_reclaimed_by_its_next_start_and_by_cleanup(fresh_daemon):
    d = fresh_daemon()
    segment = host_segment.segment_path(d.runtime_dir)
    [pool] = pool_segment.every_segment(d.runtime_dir)
    [fork_server_dir] = d.runtime_dir.glob("pymp-*")   # the fork server's socket: not in /tmp
    kill_supervisor(d)
    stale, stale_pool = os.open(segment, os.O_RDONLY), os.open(pool, os.O_RDONLY)
    try:
        assert fork_server_dir.exists()
        d.start()   # same runtime dir: the stale segments are its own, and replaced
        assert os.fstat(stale).st_nlink == 0 and segment.exists()
        assert os.fstat(stale_pool).st_nlink == 0 and pool.exists()
        assert not fork_server_dir.exists() and len(list(d.runtime_dir.glob("pymp-*"))) == 1
    finally:
        os.close(stale)
        os.close(stale_pool)
    with d.client() as client:
        assert client.ping()["pong"] is True
    kill_supervisor(d)
    d.cleanup()
    assert not segment.exists() and not pool.exists()


def test_a_start_removes_only_what_looks_like_a_dead_fork_servers_directory(monkeypatch):
    """In-process: the runtime dir may be an operator's own directory (its checks allow that), so
    a `pymp-*` there is removed only when it is a real directory of listener sockets alone."""
    monkeypatch.setattr(tempfile, "tempdir", None)   # keep_fork_server_in sets it; restored after
    runtime_dir, elsewhere = (tempfile.mkdtemp(prefix="mcpd-fs-", dir="/tmp") for _ in range(2))
    def dead_server_dir(parent: str, name: str) -> str:
        path = os.path.join(parent, name)
        os.mkdir(path)
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(os.path.join(path, "listener-ab12cd34"))
        return path
    dead = dead_server_dir(runtime_dir, "pymp-dead")
    os.mkdir(mine := os.path.join(runtime_dir, "pymp-mine"))
    open(os.path.join(mine, "notes"), "w").close()
    os.symlink(dead_server_dir(elsewhere, "pymp-target"), link := os.path.join(runtime_dir, "pymp-link"))
    keep_fork_server_in(pathlib.Path(runtime_dir))
    assert not os.path.exists(dead) and os.path.exists(os.path.join(mine, "notes"))
    assert os.path.islink(link) and os.listdir(os.path.join(elsewhere, "pymp-target"))
    assert tempfile.tempdir == runtime_dir   # the next fork server's directory goes there
    for path in (runtime_dir, elsewhere):
        shutil.rmtree(path)


def test_the_fork_server_ignores_sigterm_takes_the_children_when_killed_and_goes_with_a_stop(fresh_daemon):
    """The fork server (supervisor/launcher.py) is every child's parent. A SIGTERM to the
    daemon's whole process group (`timeout`, a shell's `kill %1`) must not kill it, and so every
    child mid-cleanup, while the children still stop on theirs. SIGKILLed, it takes the children
    with it and the supervisor restarts them through a new one. A stopped daemon leaves neither.
    One daemon for the three: each start costs ~2.5 s of the suite's CPU."""
    d = fresh_daemon()
    children = {(p["role"], p["index"]): p["pid"] for p in d.processes() if p["role"] != "supervisor"}
    server = psutil.Process(children[("worker", 0)]).parent()
    assert server.ppid() == d.process.pid and "forkserver" in " ".join(server.cmdline())
    assert {psutil.Process(pid).ppid() for pid in children.values()} == {server.pid}

    server.send_signal(signal.SIGTERM)
    os.kill(children[("worker", 0)], signal.SIGTERM)
    d.wait_until(lambda: d.pid_of("worker") not in (None, children[("worker", 0)])
                 and d.status()["state"] == "ready", 60, "the worker back")
    assert server.is_running() and not exited(server)
    assert d.pid_of("frontend") == children[("frontend", 0)]   # the server's other children lived on

    children = {(p["role"], p["index"]): p["pid"] for p in d.processes() if p["role"] != "supervisor"}
    server.kill()
    d.wait_until(lambda: all(p["pid"] not in (None, children[(p["role"], p["index"])]) and p["state"] == "running"
                             for p in d.processes() if p["role"] != "supervisor"), 60, "every child restarted")
    assert all(gone(pid) for pid in children.values())
    with d.client() as client:
        assert client.ping()["pong"] is True

    children = [p["pid"] for p in d.processes() if p["role"] != "supervisor"]
    server = psutil.Process(children[0]).parent().pid
    assert d.stop() == 0
    deadline = time.monotonic() + 5
    while not all(gone(pid) for pid in [server, *children]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [pid for pid in [server, *children] if not gone(pid)] == []

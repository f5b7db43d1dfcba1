"""What the daemon claims on the host, against a careless operator and another local user: modes
whatever the umask, runtime and state dirs that are not its own, planted links, a state dir or a
tcp port another daemon holds. Each refusal exits with its status (mcpd/daemon/refusal.py) and
the reason, before anything is written.

Acting as another user needs root: those tests fork, drop to `nobody` and report back; run
unprivileged they are skipped (CI runs them as root).
"""
import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from mcpd.client import Client
from mcpd import refusal
from mcpd.refusal import UnsafePath
from mcpd.memory import host_segment
from mcpd.security.trusted_path import check_placed_by_trusted_user
from mcpd.testing import BIN, Daemon, run_as

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")
INTERNAL_SOCKETS = ("events.ipc", "sched.ipc", "workers.ipc", "frontend.ipc")


@pytest.fixture(scope="module")
def careless(module_daemon):
    """A daemon started under umask 000, CURVE on (so it has keys), with a journaled context."""
    d = module_daemon(umask=0, security={"curve": "on"})
    with Client(f"ipc://{d.runtime_dir}/client.ipc") as local:
        context = local.context("kept")
        context["w"] = 1.0
        context.sync()
    return d


@pytest.fixture
def unstarted(fresh_daemon):
    """Daemons whose config is written but that the test starts itself (expecting a refusal)."""
    return lambda **sections: fresh_daemon(started=False, **sections)


def start(d: Daemon, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "mcpd"), "--config", str(d.config_path)], capture_output=True, text=True,
                          timeout=timeout)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def can_connect(path: Path) -> bool | str:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except PermissionError:
            return False
        except OSError as e:
            return e.strerror
    return True


# -- modes, whatever the umask ------------------------------------------------------------------

def test_modes_are_set_explicitly_under_umask_000(careless):
    run, state = careless.runtime_dir, careless.root / "state"
    assert mode(run) == 0o711   # others reach client.ipc by name (CURVE on), list nothing
    assert {name: mode(run / name) for name in (*INTERNAL_SOCKETS, "control.ipc", "mcpd.lock", "cache.lock")} \
        == {name: 0o600 for name in (*INTERNAL_SOCKETS, "control.ipc", "mcpd.lock", "cache.lock")}
    assert mode(run / "client.ipc") == 0o666   # deliberate: local users are their uid's tenant
    assert mode(host_segment.segment_path(run)) == 0o600
    assert mode(state) == mode(state / "keys") == mode(state / "keys/allowed") == mode(state / "contexts") == 0o700
    assert mode(state / "keys/server.key") == 0o644 and mode(state / "keys/server.key_secret") == 0o600
    journal = [path for path in (state / "contexts").iterdir()]
    assert journal and {path.name: mode(path) for path in journal} == {path.name: 0o600 for path in journal}
    assert mode(state / "mcpd.lock") == 0o600


@needs_root
def test_another_user_cannot_reach_the_internal_sockets(careless):
    os.chmod(careless.root, 0o711)   # mkdtemp made it 0700; let others walk to the runtime dir
    try:
        reached = run_as(NOBODY, NOBODY, lambda: {name: can_connect(careless.runtime_dir / name)
                                           for name in (*INTERNAL_SOCKETS, "control.ipc", "client.ipc")})
    finally:
        os.chmod(careless.root, 0o700)
    assert reached == {**{name: False for name in (*INTERNAL_SOCKETS, "control.ipc")}, "client.ipc": True}


# -- runtime and state directories that are not the daemon's own --------------------------------

def plant_lock_link(run: Path, victim: Path) -> None:
    run.mkdir(mode=0o700)
    victim.write_text("precious")
    (run / "mcpd.lock").symlink_to(victim)


@needs_root
def test_runtime_dir_owned_by_another_user_is_refused_untouched(unstarted):
    d = unstarted()
    plant_lock_link(d.runtime_dir, d.root / "victim")
    os.chown(d.runtime_dir, NOBODY, NOBODY)
    done = start(d)
    assert done.returncode == refusal.UNSAFE_PATH
    assert f"runtime directory (server.runtime_dir) {d.runtime_dir} is owned by uid {NOBODY}" in done.stderr
    assert (d.root / "victim").read_text() == "precious"
    assert sorted(p.name for p in d.runtime_dir.iterdir()) == ["mcpd.lock"]   # nothing bound there


@needs_root
def test_state_dir_owned_by_another_user_is_refused(unstarted):
    d = unstarted()
    (d.root / "state").mkdir(mode=0o700)
    os.chown(d.root / "state", NOBODY, NOBODY)
    done = start(d)
    assert done.returncode == refusal.UNSAFE_PATH
    assert f"state directory (server.state_dir) {d.root / 'state'} is owned by uid {NOBODY}" in done.stderr
    assert list((d.root / "state").iterdir()) == []


def test_runtime_dir_others_may_write_is_refused(unstarted):
    d = unstarted()
    d.runtime_dir.mkdir()
    os.chmod(d.runtime_dir, 0o777)
    done = start(d)
    assert done.returncode == refusal.UNSAFE_PATH
    assert "is writable by its group and others (mode 0777)" in done.stderr
    assert list(d.runtime_dir.iterdir()) == []


def test_a_directory_on_the_way_that_others_may_write_is_refused(unstarted):
    d = unstarted()
    os.chmod(d.root, 0o777)   # not sticky: anyone could swap the runtime dir inside it
    done = start(d)
    assert done.returncode == refusal.UNSAFE_PATH
    assert f"{d.root} on the way to it is writable by its group and others" in done.stderr


def test_a_planted_lock_link_is_never_followed(unstarted):
    d = unstarted()
    plant_lock_link(d.runtime_dir, d.root / "victim")   # in the daemon's own dir, by a careless operator
    done = start(d)
    assert done.returncode == refusal.UNSAFE_PATH
    assert f"{d.runtime_dir / 'mcpd.lock'} is a symbolic link" in done.stderr
    assert (d.root / "victim").read_text() == "precious"


# -- one daemon per state dir and per tcp port --------------------------------------------------

def test_second_daemon_on_the_same_state_dir_is_refused(careless, unstarted):
    d = unstarted(server={"state_dir": str(careless.root / "state")})
    done = start(d)
    assert done.returncode == refusal.IN_USE
    assert (f"another mcpd (pid {careless.process.pid}) already uses state directory {careless.root / 'state'}"
            in done.stderr)
    assert careless.mcpctl("contexts", "show", "kept", "--tenant", f"uid:{os.getuid()}").returncode == 0


def test_second_daemon_on_a_taken_tcp_port_exits_with_the_reason(careless, unstarted):
    d = unstarted(server={"tcp": careless.endpoint})
    done = start(d, timeout=120)
    assert done.returncode == refusal.IN_USE
    assert f"frontend cannot start: cannot bind the client endpoint {careless.endpoint}" in done.stderr
    assert "Address already in use" in done.stderr
    assert done.stderr.count("started frontend") == 1   # never restarted
    assert not host_segment.segment_path(d.runtime_dir).exists()
    assert careless.mcpctl("status", "--json").returncode == 0


@needs_root
@pytest.mark.parametrize("cache_bytes, why", [(1 << 41, "more than the "),   # within its range: a crash-looping scheduler
                                              (1 << 62, "must be in [1, 4398046511104]")])   # a traceback
def test_a_host_cache_larger_than_the_host_is_refused_naming_the_key(unstarted, cache_bytes, why):
    d = unstarted(cache={"bytes": cache_bytes})
    done = start(d)
    assert done.returncode == refusal.CONFIG and f"mcpd: cache.bytes = {cache_bytes}: {why}" in done.stderr, done.stderr
    assert not host_segment.segment_path(d.runtime_dir).exists()


def test_a_pool_too_small_for_one_kv_block_refuses_the_start_naming_the_keys(unstarted):
    """Every restart would meet the same pool: a refusal (exit 2, the reason), not a crash loop."""
    d = unstarted(engine={"pool_bytes": 1 << 20, "kv_block_size": 1024})
    done = start(d)
    assert done.returncode == refusal.CONFIG and "worker 0 cannot start: the KV cache gets" in done.stderr \
        and "raise engine.pool_bytes or engine.kv_fraction, or lower engine.kv_block_size" in done.stderr, done.stderr


def test_mcpctl_trusts_a_dir_root_handed_over_but_not_one_planted_in_a_sticky_dir(tmp_path):
    handed = tmp_path / "handed"   # like /run/mcpd: made by root for the service's user
    handed.mkdir(mode=0o755)
    os.chown(handed, NOBODY, NOBODY)
    check_placed_by_trusted_user(handed)
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    planted = sticky / "mcpd-0"
    planted.mkdir(mode=0o755)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match="anyone could have made it"):
        check_placed_by_trusted_user(planted)

"""Every mcpctl command against a real daemon: human output, --json shapes and exit codes."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from mcpd.protocol import codes, wire
from mcpd.protocol.codes import MCPDError
from mcpd.testing import BIN


@pytest.fixture(scope="module")
def d(module_daemon):
    return module_daemon()


def ctl(d, *args, code=0):
    done = d.mcpctl(*args)
    assert done.returncode == code, (args, done.stdout, done.stderr)
    return json.loads(done.stdout) if "--json" in args else done.stdout


def test_status_json_and_table(d):
    status = ctl(d, "status", "--json")
    assert status["state"] == "ready" and status["healthy"] and status["draining"] is False
    assert set(status["contexts"]) >= {"contexts", "bytes", "restored", "persistence"}
    assert "contexts" in ctl(d, "status") and "WORKER" in ctl(d, "status")
    assert ctl(d, "--json", "status")["pid"] == d.process.pid   # --json before the command too


def test_status_shows_p50_p90_p99_latency(d):
    with d.client() as client:
        for _ in range(20):
            client.call("ping", {})
    d.wait_until(lambda: ctl(d, "status", "--json")["requests"]["latency"].get("ping", {}).get("count", 0) >= 20,
                 30, "pings counted")
    ping = ctl(d, "status", "--json")["requests"]["latency"]["ping"]
    assert 0 < ping["p50_ms"] <= ping["p90_ms"] <= ping["p99_ms"]
    line = next(line for line in ctl(d, "status").splitlines() if line.split()[:1] == ["ping"])
    assert line.index("p50") < line.index("p90") < line.index("p99")


def test_runtime_dir_from_environment(d):
    done = subprocess.run([str(BIN / "mcpctl"), "status", "--json"], capture_output=True, text=True,
                          env={**os.environ, "MCPD_RUNTIME_DIR": str(d.runtime_dir)}, timeout=30)
    assert done.returncode == 0 and json.loads(done.stdout)["pid"] == d.process.pid


def test_ping(d):
    assert ctl(d, "ping", "--json") == {"pong": True, "pid": d.process.pid}
    assert f"supervisor pid {d.process.pid}" in ctl(d, "ping")


HOSTILE_CONTROL_ARGS = [
    ("contexts.show", {"id": 7}, "`$.id`"), ("contexts.drop", {}, "field `id`"),
    ("contexts.list", {"limit": True}, "`$.limit`"), ("workers.restart", {"index": "0"}, "`$.index`"),
    ("ping", {"x": 1}, "field `x`"), ("reload", {"timeout_s": float("nan")}, "`$.timeout_s`"),
    ("models.split", {"model": "embedded", "weights": {"a": float("inf")}}, "`$.weights[...]`"),
    ("models.shadow", {"model": "embedded", "fraction": 2}, "`$.fraction`"),
]


def test_control_args_are_checked_by_the_daemon(d):
    """A control client other than mcpctl gets BAD_REQUEST naming the argument the table refuses,
    and the scheduler, where context and model ops run, is never handed it."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{d.runtime_dir}/control.ipc")
        for request_id, (op, args, named) in enumerate(HOSTILE_CONTROL_ARGS):
            sock.send(wire.encode_request(op, request_id, args))
            assert sock.poll(30_000)
            reply = wire.decode_reply(sock.recv())
            assert (reply["id"], reply["kind"], reply["code"]) == (request_id, "error", codes.BAD_REQUEST), reply
            assert named in reply["message"] and repr(op) in reply["message"], reply
    finally:
        sock.close()
        context.term()
    assert d.control("contexts.list")["total"] >= 0 and d.status()["healthy"]


def test_version_and_config(d):
    version = ctl(d, "version", "--json")
    assert version["daemon"]["version"] == version["mcpctl"] and version["daemon"]["protocol"] >= 1
    config = ctl(d, "config", "--json")
    assert config["path"] == str(d.config_path)
    assert config["config"]["server"]["runtime_dir"] == str(d.runtime_dir)
    assert "[workers]" in ctl(d, "config")


def test_contexts_list_show_drop(d):
    with d.client() as client:
        alpha = client.context("alpha")
        alpha["w"] = 1.5
        alpha.sync()
    with d.client() as other:
        other.call("context.open", {"id": "beta"}, tenant="bob")
    listed = ctl(d, "contexts", "list", "--json")
    assert {(c["owner"], c["id"]) for c in listed["contexts"]} >= {("default", "alpha"), ("bob", "beta")}
    assert [c["id"] for c in ctl(d, "contexts", "list", "--tenant", "bob", "--json")["contexts"]] == ["beta"]
    shown = ctl(d, "contexts", "show", "alpha", "--json")
    assert shown["version"] == 1 and [f["name"] for f in shown["fields"]] == ["tokens", "w"]
    assert "alpha" in ctl(d, "contexts", "list")
    assert ctl(d, "contexts", "drop", "beta", "--tenant", "bob", "--json") == {"dropped": True}
    assert ctl(d, "contexts", "drop", "beta", "--tenant", "bob", "--json", code=1) == {"dropped": False}
    assert "NOT_FOUND" in d.mcpctl("contexts", "show", "nope").stderr
    ctl(d, "contexts", "show", "nope", code=1)


def test_drain_and_resume(d):
    assert "nothing in flight" in ctl(d, "drain", "--wait")
    assert ctl(d, "status", "--json")["state"] == "draining"
    with d.client() as client:
        with pytest.raises(MCPDError) as raised:
            client.generate("x", max_tokens=1)
        assert raised.value.code == codes.UNAVAILABLE
        assert ctl(d, "resume", "--json") == {"draining": False}
        d.wait_until(lambda: ctl(d, "status", "--json")["state"] == "ready", 10, "resumed")
        assert client.generate("x", max_tokens=1).completion_tokens == 1


def test_reload_applies_live_keys_and_names_the_rest(d):
    original = d.config_path.read_text()
    try:
        d.config_path.write_text(_edited(original))
        result = ctl(d, "reload", "--wait", "--json")
        assert {"server.log_level", "supervisor.ready_timeout_s", "scheduler.max_queue",
                "scheduler.classes"} <= set(result["applied"])
        assert result["needs_restart"] == ["workers.threads"] and result["unconfirmed"] == []
        assert sorted(result["confirmed"]) == ["frontend 0", "scheduler 0", "worker 0"]
        effective = ctl(d, "config", "--json")["config"]
        assert effective["server"]["log_level"] == "debug" and effective["workers"]["threads"] == 0
        assert effective["scheduler"]["max_queue"] == 500 and "bulk" in effective["scheduler"]["classes"]
        assert "needs restart: workers.threads" in ctl(d, "reload")
    finally:
        d.config_path.write_text(original)
        ctl(d, "reload", "--wait")
    assert ctl(d, "config", "--json")["config"]["server"]["log_level"] == "info"


def _edited(original: str) -> str:
    return (original.replace("[workers]\n", "[workers]\nthreads = 3\n")
            .replace("[supervisor]\n", "[supervisor]\nready_timeout_s = 200.0\n")
            .replace("[server]\n", '[server]\nlog_level = "debug"\n')
            # The classes replaced by two (and back when the original returns): live, like every scheduler key.
            + "\n[scheduler]\nmax_queue = 500\n\n[scheduler.classes.normal]\nrank = 1\n"
              "\n[scheduler.classes.bulk]\nrank = 0\n")


def test_bad_config_reload_fails_and_keeps_running(d):
    original = d.config_path.read_text()
    try:
        d.config_path.write_text(original + "\n[nonsense]\n")
        assert "unknown section" in d.mcpctl("reload").stderr
        ctl(d, "reload", code=1)
    finally:
        d.config_path.write_text(original)
    assert ctl(d, "status", "--json")["healthy"]


def test_a_reload_of_a_file_that_is_not_utf8_text_fails_and_keeps_running(d):
    """The file's bytes are checked like its keys: refused by the reload, never raised through
    the supervisor's loop (which would take the daemon down)."""
    original = d.config_path.read_bytes()
    try:
        d.config_path.write_bytes(original + b"\n# caf\xe9\n")
        done = d.mcpctl("reload")
        assert done.returncode == 1 and f"config file {d.config_path}: not UTF-8 text" in done.stderr, done.stderr
    finally:
        d.config_path.write_bytes(original)
    assert ctl(d, "status", "--json")["healthy"]


def test_a_reload_naming_a_model_mcpd_cannot_run_fails_and_keeps_running(d, tmp_path):
    """Checked like a start (architecture.check_configured): the reason names the key and the file."""
    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"]}')
    original = d.config_path.read_text()
    try:
        d.config_path.write_text(original + f'\n[model]\npath = "{tmp_path}"\n' if "[model]" not in original
                                 else original.replace("[model]\n", f'[model]\npath = "{tmp_path}"\n', 1))
        assert f"model: {tmp_path}: architecture 'FalconForCausalLM' is not supported" in d.mcpctl("reload").stderr
    finally:
        d.config_path.write_text(original)
    assert ctl(d, "status", "--json")["healthy"]


@pytest.mark.parametrize("plant", [os.mkfifo, lambda path: path.write_text("[" * 100_000 + "]" * 100_000)])
def test_a_reload_naming_a_checkpoint_whose_config_json_is_hostile_fails_and_keeps_running(d, tmp_path, plant):
    """The supervisor reads config.json itself: a FIFO must not hang it, nor nesting past the
    recursion limit raise through its loop."""
    plant(tmp_path / "config.json")
    original = d.config_path.read_text()
    try:
        d.config_path.write_text(original.replace("[engine]\n", f'[model]\npath = "{tmp_path}"\n\n[engine]\n', 1))
        done = d.mcpctl("reload")
        assert done.returncode == 1 and f"model: {tmp_path / 'config.json'}: not valid JSON" in done.stderr, done.stderr
    finally:
        d.config_path.write_text(original)
    assert ctl(d, "status", "--json")["healthy"]


def test_workers_list_and_restart(d):
    workers = ctl(d, "workers", "--json")["workers"]
    assert [w["index"] for w in workers] == [0] and workers[0]["device"] == "cpu"
    assert "WORKER" in ctl(d, "workers", "list")
    result = ctl(d, "workers", "restart", "0", "--wait", "--json")
    assert result["new_pid"] != result["old_pid"]
    ctl(d, "workers", "restart", "7", code=1)
    dead = d.pid_of("worker")   # killed, then asked for before the supervisor's loop has seen it die
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(dead) and time.monotonic() < deadline:   # no sleep: ask at once
        pass
    assert d.control("workers.restart", {"index": 0})["old_pid"] in (None, dead)   # was CONFLICT "(stopped)"
    d.wait_until(lambda: d.pid_of("worker") not in (None, dead) and all(
        p["state"] == "running" for p in d.processes()), 60, "the worker back")
    with d.client() as client:
        assert client.generate("x", max_tokens=2, ignore_eos=True).completion_tokens == 2


def test_usage_errors_exit_2(d):
    ctl(d, "contexts", code=2)
    ctl(d, "workers", "restart", "x", code=2)


@pytest.mark.parametrize("seconds", ["nan", "inf", "1e300", "-1", "0", "abc"])
def test_a_timeout_that_is_no_number_of_seconds_is_a_usage_error(d, seconds):
    """nan, inf and 1e300 would overflow zmq's poll (a traceback); -1 would wait forever, 0 mean the default."""
    done = d.mcpctl("--timeout", seconds, "status")
    assert done.returncode == 2 and f"argument --timeout: '{seconds}': give seconds from 0.001 to 86400" in done.stderr, \
        done.stderr


# -- talking only to a daemon it can trust, and to an older one ---------------------------------

@pytest.fixture
def stand_in(tmp_path):
    """A control socket in a runtime dir of the test's: what an older daemon, or a stranger, binds."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    sock.bind(f"ipc://{runtime_dir}/control.ipc")
    yield runtime_dir, sock
    sock.close()


def mcpctl(runtime_dir, *args) -> subprocess.Popen:
    return subprocess.Popen([str(BIN / "mcpctl"), "--runtime-dir", str(runtime_dir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("as_json", [False, True])
def test_version_from_a_daemon_that_reports_none(stand_in, as_json):
    runtime_dir, sock = stand_in
    asking = mcpctl(runtime_dir, "version", *(["--json"] if as_json else []))
    identity, header = sock.recv_multipart()
    request = wire.decode_header(header)
    sock.send_multipart([identity, msgpack.packb({"v": 1, "id": request["id"], "kind": "ok", "result": {}})])
    out, err = asking.communicate(timeout=30)
    assert asking.returncode == 0, err
    if as_json:
        assert json.loads(out)["daemon"] == {}
    else:
        assert "mcpd unknown (protocol unknown, Python unknown)" in out


def refused_before_sending(runtime_dir, sock, reason: str) -> None:
    public = zmq.curve_keypair()[0].decode()
    asking = mcpctl(runtime_dir, "keys", "allow", "--", "mallory", public)
    _, err = asking.communicate(timeout=30)
    assert asking.returncode == 1 and reason in err, err
    assert not sock.poll(0)   # mcpctl has exited: anything it sent would be here already


def test_refuses_a_runtime_dir_others_may_write(stand_in):
    runtime_dir, sock = stand_in
    os.chmod(runtime_dir, 0o777)
    refused_before_sending(runtime_dir, sock, "is writable by its group and others (mode 0777)")


@pytest.mark.skipif(os.geteuid() != 0, reason="planting as another user needs root (CI runs as root)")
def test_refuses_a_runtime_dir_another_user_planted_in_tmp():
    planted = Path(tempfile.mkdtemp(prefix="mcpd-planted-", dir="/tmp"))
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(f"ipc://{planted}/control.ipc")
        os.chown(planted, 65534, 65534)
        refused_before_sending(planted, sock, "anyone could have made it")
    finally:
        sock.close()
        shutil.rmtree(planted)

"""Lifecycle: systemd notifications, graceful stop, one instance per runtime dir, bad config."""
import os
import signal
import subprocess

import pytest

from mcpd.cli import control
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.testing import BIN

pytestmark = pytest.mark.slow   # each test starts and stops a daemon of its own


def test_ready_waits_for_the_scheduler_then_stopping_and_a_clean_exit_after_inflight_requests_finish(fresh_daemon):
    """READY only once the scheduler has read every worker's Hello: with the scheduler stopped
    (SIGSTOP) it does not come, however long the loaded worker waits. Before, it came at once,
    and a request right after it could find no worker known (HTTP answered 404 for the model)."""
    d = fresh_daemon(started=False)
    d.start(wait=False)
    def scheduler_ready() -> bool:   # it has told the supervisor so: the worker is what READY waits for
        return (d.runtime_dir / "control.ipc").exists() and any(
            p["role"] == "scheduler" and p["state"] == "running" for p in d.processes())
    d.wait_until(scheduler_ready, 60, "scheduler ready")
    scheduler = d.pid_of("scheduler")
    os.kill(scheduler, signal.SIGSTOP)
    try:
        d.wait_until(lambda: "model loaded" in d.log(), 60, "the worker's model loaded")
        with pytest.raises(TimeoutError):
            d.wait_for_notification("READY=1", 1.0)
    finally:
        os.kill(scheduler, signal.SIGCONT)
    d.wait_for_notification("READY=1", 60)
    with d.client() as client:
        assert [w["ready"] for w in client.status()["workers"]] == [True]
        stream = client.generate("drain", max_tokens=60, temperature=0, ignore_eos=True, stream=True)
        iterator = iter(stream)
        next(iterator)
        d.process.terminate()
        rest = list(iterator)
    assert stream.result is not None and stream.result.completion_tokens == 60
    assert rest
    assert d.stop() == 0
    assert "STOPPING=1" in d.notifications
    assert d.notifications.index("STOPPING=1") > d.notifications.index("READY=1")


def test_while_it_stops_mcpd_answers_status_refuses_changes_and_then_removes_its_control_socket(fresh_daemon):
    """A stop's drain (its one request held by a stopped worker) keeps the supervisor answering:
    `status` says stopping, an op that changes things is UNAVAILABLE. Before, no control op was
    answered until the process exited, and a caller waited out its whole timeout."""
    d = fresh_daemon(supervisor={"stop_grace_s": 120.0, "stats_interval_s": 0.1})
    worker = d.pid_of("worker")
    with d.client() as client:
        stream = client.generate("held", max_tokens=20, temperature=0, ignore_eos=True, stream=True)
        iterator = iter(stream)
        next(iterator)
        os.kill(worker, signal.SIGSTOP)
        try:
            d.process.terminate()
            d.wait_until(lambda: d.control("status", timeout=20)["state"] == "stopping", 60, "state stopping")
            with pytest.raises(MCPDError) as refused:
                d.control("reload", timeout=20)
            assert refused.value.code == codes.UNAVAILABLE and "stopping" in str(refused.value)
            assert d.control("ping", timeout=20)["pong"] is True
        finally:
            os.kill(worker, signal.SIGCONT)
        rest = list(iterator)
    assert rest and stream.result.completion_tokens == 20
    assert d.stop() == 0
    assert not (d.runtime_dir / "control.ipc").exists()
    with pytest.raises(control.Unreachable, match="no control socket"):
        control.call_at(d.runtime_dir, "status")


def test_second_instance_on_same_runtime_dir_refuses(daemon):
    done = subprocess.run([str(BIN / "mcpd"), "--config", str(daemon.config_path)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "already uses runtime directory" in done.stderr
    assert daemon.client().ping()["pong"] is True   # the first one is untouched


def test_bad_config_names_key_and_value(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[engine]\nkv_block_size = 12\n')
    done = subprocess.run([str(BIN / "mcpd"), "--config", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "engine.kv_block_size = 12" in done.stderr
    path.write_text('[workers]\ncount = "two"\n')
    done = subprocess.run([str(BIN / "mcpd"), "--config", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "workers.count = 'two'" in done.stderr
    long_dir = tmp_path / ("r" * (100 - len(str(tmp_path)))) / "run"   # 104 bytes: its sockets' paths would not fit
    path.write_text(f'[server]\nruntime_dir = "{long_dir}"\n')
    done = subprocess.run([str(BIN / "mcpd"), "--config", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "server.runtime_dir" in done.stderr and "at most 94" in done.stderr
    assert "Traceback" not in done.stderr and not long_dir.exists()

"""The supervisor dying (SIGKILL, no chance to clean up) takes every child with it."""
import os
import signal

import psutil


def test_sigkill_supervisor_leaves_no_orphans(fresh_daemon):
    d = fresh_daemon()
    children = [psutil.Process(p["pid"]) for p in d.status()["processes"] if p["role"] != "supervisor"]
    assert len(children) == 3
    os.kill(d.process.pid, signal.SIGKILL)
    d.process.wait(10)
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"children outlived the supervisor: {[p.pid for p in alive]}"

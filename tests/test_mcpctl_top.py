"""`mcpctl top` against a real daemon: its frame shows the models, the classes and the requests in
flight longest, and a bad --interval is refused before anything is asked."""
import json
import signal
import subprocess

import pytest

from mcpd.testing import BIN

LONG_TOKENS = 20_000   # outlasts the test: the embedded model writes ~2,000 tokens a second at best
HOSTILE_TENANT = "mallory\x1b[2J"   # a clear-screen sequence a client put in its tenant


@pytest.fixture(scope="module")
def d(module_daemon):
    return module_daemon(model={"max_model_len": LONG_TOKENS + 64}, limits={"max_new_tokens": LONG_TOKENS},
                         engine={"pool_bytes": 256 << 20})


def row_of(frame: str, first_cell: str) -> list[str]:
    return next(line.split() for line in frame.splitlines() if line.split()[:1] == [first_cell])


def test_top_once_shows_models_classes_and_the_slowest_request(d):
    with d.client() as client:
        assert client.generate("warm", max_tokens=1).completion_tokens == 1
    status = d.status()
    model = status["models"]["default_model"]
    version = status["models"]["models"][model]["primary"]
    with d.client(tenant=HOSTILE_TENANT) as client:
        rid = client.send("generate", {"prompt": "run long", "max_tokens": LONG_TOKENS, "ignore_eos": True,
                                       "stream": True}, priority="high")
        first = client.receive(rid)
        assert first["kind"] == "chunk", first.get("message")
        slowest = d.status()["requests"]["slowest"]
        assert [(r["tenant"], r["op"], r["model"]) for r in slowest] == [(HOSTILE_TENANT, "generate", None)]
        done = d.mcpctl("top", "--once")
        client.cancel(rid)
    assert done.returncode == 0, done.stderr
    frame = done.stdout
    assert "\x1b" not in frame   # the tenant's escape sequence is shown, not obeyed
    assert row_of(frame, model)[:2] == [model, version]
    answered = int(row_of(frame, model)[4])
    assert answered >= 1 and row_of(frame, model)[5] != "-"   # the warm-up's answer and its p50
    assert row_of(frame, "high")[:1] == ["high"] and row_of(frame, "low")[:1] == ["low"]
    assert row_of(frame, str(slowest[0]["rid"]))[1:4] == ["mallory\\x1b[2J", "generate", model]


def test_top_json_is_the_status_report(d):
    done = d.mcpctl("top", "--once", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report.keys() == d.control("status").keys() and report["pid"] == d.process.pid
    assert "slowest" in report["requests"] and "max_queue" in report["scheduler"]["classes"]["high"]


@pytest.mark.parametrize("interval", ["0", "-1", "abc", "nan", "7200"])
def test_bad_interval_is_refused(d, interval):
    done = d.mcpctl("top", "--interval", interval)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "--interval" in done.stderr and "give seconds from 0.1 to 3600" in done.stderr
    assert done.stdout == ""



@pytest.mark.parametrize("command", [["top", "--interval", "0.2"], ["status", "--watch", "--interval", "0.2"]])
def test_redraws_until_interrupted(d, tmp_path, command):
    """Off a terminal each frame follows the last, without the screen-clearing sequence; Ctrl-C ends it with 0."""
    out = tmp_path / "frames"
    frame_head = f"mcpd {d.status()['version']}"
    with out.open("w") as sink:
        watching = subprocess.Popen([str(BIN / "mcpctl"), "--runtime-dir", str(d.runtime_dir), *command],
                                    stdout=sink, stderr=subprocess.PIPE, text=True)
        try:
            d.wait_until(lambda: out.read_text().count(frame_head) >= 2, 30, "two frames")
            watching.send_signal(signal.SIGINT)
            assert watching.wait(timeout=30) == 0, watching.stderr.read()
        finally:
            watching.kill()
            watching.wait()
    assert "\x1b" not in out.read_text()

"""docs/CLUSTER.md's nginx block, as written there (addresses replaced by loopback ones), run by a
real nginx in front of two real daemons sharing a real Redis: every request on one context
lands on one node, and the contexts spread over both."""
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mcpd.testing import free_port
from set_up_tools import require

pytestmark = pytest.mark.slow
DOCS = Path(__file__).parent.parent / "docs" / "CLUSTER.md"
MODEL = "mcpd-embedded-llama"


def documented_block() -> str:
    return re.search(r"```nginx\n(.*?)```", DOCS.read_text(), re.S).group(1)


def nginx_config(root: Path, port: int, upstreams: list[str]) -> str:
    """The documented block inside a minimal nginx.conf of the test's own, each answer saying
    which node gave it."""
    block = re.sub(r"\n\s*server 10\.0\.0\.\d+:8000;", "", documented_block())
    servers = "".join(f"\n    server {address};" for address in upstreams)
    block = block.replace("    keepalive 64;", servers.lstrip("\n") + "\n    keepalive 64;")
    block = block.replace("listen 80;", f"listen 127.0.0.1:{port};\n    add_header mcpd-node $upstream_addr always;")
    temporary = " ".join(f"{kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                        "uwsgi", "scgi"))
    return (f"daemon off;\nuser root;\nworker_processes 1;\npid {root / 'nginx.pid'};\n"
            f"error_log {root / 'error.log'};\nevents {{ worker_connections 64; }}\n"
            f"http {{\naccess_log off;\n{temporary}\n{block}\n}}\n")


@pytest.fixture
def nginx_in_front(fresh_daemon, redis_server, tmp_path):
    require(shutil.which("nginx"), "nginx", "`make setup-test` installs Debian's nginx-light")
    nodes = [fresh_daemon(http={"listen": f"127.0.0.1:{free_port()}"},
                          cluster={"redis": redis_server.url, "node_id": name}) for name in ("a", "b")]
    upstreams = [node.control("config")["config"]["http"]["listen"] for node in nodes]
    port = free_port()
    (tmp_path / "nginx.conf").write_text(nginx_config(tmp_path, port, upstreams))
    nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                              "-e", str(tmp_path / "error.log")], stderr=subprocess.STDOUT,
                             stdout=open(tmp_path / "nginx.out", "wb"))
    try:
        _wait_for_port(port, nginx, tmp_path)
        yield f"http://127.0.0.1:{port}", set(upstreams)
    finally:
        nginx.terminate()
        nginx.wait(30)


def _wait_for_port(port: int, nginx: subprocess.Popen, root: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if nginx.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start:\n{(root / 'nginx.out').read_text()}"
                                   f"{(root / 'error.log').read_text()}") from None
            time.sleep(0.05)


def request(base: str, method: str, path: str, body: dict | None = None) -> tuple[int, str, dict]:
    """(status, the node that answered, JSON body) of one request through nginx."""
    data = json.dumps(body).encode() if body is not None else None
    sent = urllib.request.Request(base + path, data=data, method=method,
                                  headers={"Content-Type": "application/json", "mcpd-tenant": "acme"})
    try:
        with urllib.request.urlopen(sent, timeout=60) as answer:
            return answer.status, answer.headers["mcpd-node"], json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, refused.headers["mcpd-node"], json.loads(refused.read())


def test_a_context_s_requests_land_on_one_node_and_contexts_spread(nginx_in_front):
    base, nodes = nginx_in_front
    turn = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    served_by = {}
    for context_id in ("chat-1", "chat-2"):
        status, first, _ = request(base, "POST", f"/v1/contexts/{context_id}/chat/completions", turn)
        assert status == 200
        status, second, shown = request(base, "GET", f"/v1/contexts/{context_id}")
        assert status == 200 and shown["version"] == 1
        status, third, _ = request(base, "POST", f"/v1/contexts/{context_id}/chat/completions", turn)
        assert status == 200 and first == second == third
    for n in range(40):   # unknown contexts: routed all the same, answered 404 by their node
        context_id = f"c{n}"
        answers = [request(base, "GET", f"/v1/contexts/{context_id}") for _ in range(2)]
        assert [status for status, _, _ in answers] == [404, 404]
        assert answers[0][1] == answers[1][1]
        served_by[context_id] = answers[0][1]
    assert set(served_by.values()) == nodes   # 40 contexts all on one of two nodes: odds 2**-39

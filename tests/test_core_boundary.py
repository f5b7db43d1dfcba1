"""Each process is a socket-free core and a process module (README's map of the code): the
process module alone encodes and decodes what its sockets carry, attaches shared memory and opens
files, so that a core's test hands it typed messages and time and reads typed messages back."""
import re
from pathlib import Path

import mcpd

DAEMON = Path(mcpd.__file__).parent / "daemon"
CORES = ("frontend/core.py", "scheduler/core.py", "worker/core.py", "worker/handler_core.py", "supervisor/core.py",
         "keeper_core.py")
SOCKET_SIDE = {"process.py", "batch.py", "child.py", "messages.py"}   # the process modules and what they share


def lines_matching(paths, pattern: str) -> list[str]:
    return [f"{path.relative_to(DAEMON)}:{n}: {line.strip()}" for path in paths
            for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(pattern, line)]


def test_only_the_process_modules_encode_or_decode_messages():
    paths = [p for p in sorted(DAEMON.rglob("*.py")) if p.name not in SOCKET_SIDE]
    assert lines_matching(paths, r"messages\.(en|de)code\(") == []


def test_the_cores_hold_no_socket_shared_memory_or_file():
    found = lines_matching([DAEMON / core for core in CORES],
                           r"\bimport zmq\b|from zmq\b|host_segment\.|pool_segment\.|open_store\(|\bopen\(")
    assert found == []

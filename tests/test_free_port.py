"""The test harness's ports (mcpd.testing.free_port): never from the kernel's ephemeral range,
where another process's outgoing connection could take one before a daemon binds it, and never
the same in two pytest-xdist processes."""
import socket

from mcpd import testing


def test_ports_come_from_below_the_ephemeral_range_and_skip_one_that_is_held():
    held = testing.free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", held))
        listener.listen()
        ports = [testing.free_port() for _ in range(len(testing._share) + 1)]   # once round the share
    assert held not in ports
    assert all(testing.LOWEST_PORT <= port < testing._ephemeral_range_start() for port in ports)


def test_each_xdist_process_has_a_share_of_its_own(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    shares = []
    for index in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        shares.append(set(testing._own_share()))
    assert all(shares) and not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])
    assert max(max(share) for share in shares) < testing._ephemeral_range_start()

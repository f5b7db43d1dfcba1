"""A tool the set-up installs, missing: a skip on a developer's machine, a failure under CI."""
import pytest

from set_up_tools import require


def test_a_found_tool_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require("/usr/bin/redis-server", "redis-server", "apt") == "/usr/bin/redis-server"


def test_a_missing_tool_skips_outside_ci_saying_how_to_get_it(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"redis-server is not installed \(apt install redis-server\)"):
        require(None, "redis-server", "apt install redis-server")


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_a_missing_tool_fails_under_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="under CI the set-up must have installed it"):
        require(None, "nginx", "apt install nginx-light")

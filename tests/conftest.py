import pytest

from mcpd.testing import Daemon


@pytest.fixture(scope="module")
def daemon():
    """One real daemon shared by a test module (start-up costs seconds: spawn + model load)."""
    d = Daemon(limits={"max_message_bytes": 1 << 20, "max_header_bytes": 8192}).start()
    yield d
    d.stop()
    d.cleanup()


@pytest.fixture
def fresh_daemon():
    """A daemon of the test's own, for tests that kill or stop it."""
    made = []

    def start(**sections):
        made.append(Daemon(**sections).start())
        return made[-1]
    yield start
    for d in made:
        d.stop()
        d.cleanup()

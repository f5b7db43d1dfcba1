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
    """A daemon of the test's own, for tests that kill or stop it; with started=False only its
    config is written (for tests that start mcpd themselves, expecting it to refuse)."""
    made = []

    def start(started: bool = True, **sections):
        made.append(Daemon(**sections))
        return made[-1].start() if started else made[-1]
    yield start
    for d in made:
        d.stop()
        d.cleanup()

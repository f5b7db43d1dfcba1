"""A request's tenant, as its header names it, and the one of a request whose header names none
(and with CURVE off nothing else does)."""
from __future__ import annotations

DEFAULT_TENANT = "default"


def tenant_of(header: dict) -> str:
    return header.get("tenant") or DEFAULT_TENANT

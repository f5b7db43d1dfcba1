"""Bundled Python clients: `Client` (blocking) and `AsyncClient` (asyncio)."""
from mcpd.client.async_client import AsyncClient
from mcpd.client.curve import CurveKeys
from mcpd.protocol.results import GenerateChunk, GenerateResult
from mcpd.client.sync_client import Client, Stream

__all__ = ["Client", "AsyncClient", "CurveKeys", "Stream", "GenerateChunk", "GenerateResult"]

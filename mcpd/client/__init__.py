"""Bundled Python clients: `Client` (blocking) and `AsyncClient` (asyncio)."""
from mcpd.client.async_client import AsyncClient
from mcpd.client.curve import CurveKeys
from mcpd.client.replies import Chunk, GenerateResult
from mcpd.client.sync_client import Client, Stream

__all__ = ["Client", "AsyncClient", "CurveKeys", "Stream", "Chunk", "GenerateResult"]

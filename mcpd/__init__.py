"""mcpd: a single-node inference daemon with versioned, delta-synced model contexts."""
from mcpd.protocol.codes import MCPDError

__version__ = "0.1.0"


def __getattr__(name):
    # The clients import zmq; keep `import mcpd` cheap for the daemon's own processes.
    if name == "Client":
        from mcpd.client.sync_client import Client
        return Client
    if name == "AsyncClient":
        from mcpd.client.async_client import AsyncClient
        return AsyncClient
    raise AttributeError(name)


__all__ = ["Client", "AsyncClient", "MCPDError", "__version__"]

"""Several mcpd nodes sharing contexts through Redis (docs/CLUSTER.md)."""

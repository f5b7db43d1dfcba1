"""The front-end process (process.py): the only sockets clients reach. Its gate (gate.py: binding
and CURVE), what clients have half sent (incoming.py), replies on their way out (outbox.py), each
client's connection (peers.py), and the figures it keeps (latency.py, request_metrics.py)."""

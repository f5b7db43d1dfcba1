"""The daemon's processes, a package each: supervisor/ (mcpd itself: the process table, control
ops, status, metrics, systemd), frontend/ (the client sockets and the gate), scheduler/ (its
socket-free core, its loop and its policies) and worker/ (a worker's core and loop); the pool
keeper is its core (keeper_core.py) and its process (pool_keeper.py). Beside them what every process shares: the messages
between processes (messages.py), which socket carries which (channels.py), batches (batch.py),
a child's start and reporting (child.py, child_stats.py), live reload (live_config.py), logs."""

"""The supervisor, the `mcpd` process itself: a core that decides (core.py: the children's
restarts in process_table.py, mcpctl's answers in admin.py and status.py) and a process that owns
its sockets, signals and directories (process.py), starts children through a fork server
(launcher.py), serves metrics (metrics.py), and speaks to systemd (sdnotify.py) under one lock
per runtime and state directory (instance_lock.py)."""

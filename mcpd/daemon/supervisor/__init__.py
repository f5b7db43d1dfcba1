"""The supervisor, the `mcpd` process itself (process.py): it starts and watches the others
(process_table.py, through a fork server), answers mcpctl (admin.py, status.py), serves
metrics (metrics.py), and speaks to systemd (sdnotify.py) under one lock per runtime and state
directory (instance_lock.py)."""

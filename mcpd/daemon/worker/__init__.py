"""A worker process: its socket-free core (core.py: the engine, the requests it runs, what each
produced) and the loop around it with its sockets and the engine's start-up (process.py)."""

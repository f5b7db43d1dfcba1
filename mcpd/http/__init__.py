"""The OpenAI-compatible HTTP listener: a process of its own (`[http] listen`), a client of the
front-end on client.ipc like any other. See server.py for why it is a process of its own."""

"""The OpenAI-compatible HTTP listener (`[http] listen`), on the front-end's event loop; its
requests enter the front-end like a ZeroMQ client's. server.py says why it lives there."""

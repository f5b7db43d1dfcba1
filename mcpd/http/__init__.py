"""The HTTP listener (`[http] listen`), on the front-end's event loop: OpenAI's API and the Open
Inference Protocol (KServe v2); its requests enter the front-end like a ZeroMQ client's.
server.py says why it lives there."""

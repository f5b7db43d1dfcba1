"""The control side of inference: requests, batching, the KV cache's blocks, sampling, text.

The worker process drives an Engine: add_request(), abort(), and step() in a loop while has_work.

Engine and StepOutput are imported lazily, so that mcpd.cpu.threads can set up OpenMP's
environment in a process that has not imported torch yet.
"""
from mcpd.protocol.sampling import SamplingParams   # the one request type, as the front-end decoded it

__all__ = ["Engine", "SamplingParams", "StepOutput"]


def __getattr__(name: str):
    if name in ("Engine", "StepOutput"):
        from mcpd.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

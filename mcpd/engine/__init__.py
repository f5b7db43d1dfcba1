"""The control side of inference: requests, batching, the KV cache's blocks, sampling, text.

The worker process drives an Engine: add_request(), abort(), and step() in a loop while has_work.
"""
from mcpd.engine.engine import Engine, StepOutput
from mcpd.engine.sequence import SamplingParams

__all__ = ["Engine", "SamplingParams", "StepOutput"]

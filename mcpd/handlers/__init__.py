"""Serving models other than language models: a Handler (handler.py) names its tensors
(tensors.py) and runs batches that the worker forms (batcher.py) behind a result cache
(result_cache.py)."""

"""``expertcache serve``: an OpenAI-compatible HTTP server over the offloaded runtime with continuous batching.

:mod:`~expertcache.serve.engine` (one thread owns the model; requests join and leave the running batch between
decode steps), :mod:`~expertcache.serve.kv` (the left-padded batch KV cache: add a prefilled row, drop finished
rows), :mod:`~expertcache.serve.attention` (row-wise decode attention: a row decodes alone and inside a batch
bit-identically), :mod:`~expertcache.serve.app` (FastAPI routes, OpenAI error bodies, SSE, Prometheus metrics).
Only the engine needs torch/transformers; the app needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

from expertcache.serve.engine import Engine, QueueFull, Request, SamplingParams, ShuttingDown

__all__ = ["Engine", "Request", "SamplingParams", "QueueFull", "ShuttingDown"]

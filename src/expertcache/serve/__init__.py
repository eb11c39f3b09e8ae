"""``expertcache serve``: an OpenAI-compatible HTTP server over the offloaded runtime with continuous batching.

:mod:`~expertcache.serve.engine` (one thread owns the model; requests join and leave the running batch between
decode steps), :mod:`~expertcache.serve.kv` (the left-padded batch KV cache: add a prefilled row, drop finished
rows), :mod:`~expertcache.serve.attention` (row-wise decode attention: a row decodes alone and inside a batch
bit-identically), :mod:`~expertcache.serve.app` (FastAPI routes, OpenAI error bodies, SSE, Prometheus metrics),
:mod:`~expertcache.serve.defaults` (what the command line and the app both read; no heavy import).
Only the engine needs torch/transformers; the app needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
The engine's names are imported on first use, so that ``expertcache.serve.defaults`` stays light.
"""

__all__ = ["Engine", "Request", "SamplingParams", "QueueFull", "ShuttingDown"]


def __getattr__(name: str):
    if name in __all__:
        from expertcache.serve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'expertcache.serve' has no attribute {name!r}")

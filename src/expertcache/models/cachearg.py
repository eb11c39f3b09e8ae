"""The name of transformers' KV-cache argument: ``cache`` from transformers 5.24, ``past_key_values`` before.

transformers 5.24 renamed a model's ``past_key_values`` (argument and output field) to ``cache``; the old name still
works there but warns twice per process (a ``FutureWarning`` and a log line) and raises under
``PYTHONWARNINGS=error``. Every call into a transformers model passes its cache through :func:`cache_kw` and reads it
back with :func:`out_cache`, so each version gets its current name and no warning.
"""

from __future__ import annotations

import functools

__all__ = ["CACHE_ARG", "cache_kw", "out_cache"]


@functools.lru_cache(maxsize=1)
def _name() -> str:
    from dataclasses import fields

    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    return "cache" if "cache" in {f.name for f in fields(MoeCausalLMOutputWithPast)} else "past_key_values"


def cache_kw(cache) -> dict:
    """``{name: cache}`` for a transformers model's or layer's forward, in this transformers' current name."""
    return {_name(): cache}


def out_cache(out):
    """The cache of a transformers model output (``out.cache``, or ``out.past_key_values`` before 5.24)."""
    return getattr(out, _name())


def __getattr__(name):  # CACHE_ARG, read when first asked (it imports transformers)
    if name == "CACHE_ARG":
        return _name()
    raise AttributeError(name)

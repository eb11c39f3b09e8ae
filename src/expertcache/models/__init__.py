"""The only transformers-aware code: adapters that put cache-aware routing inside real HF MoE models.

- :func:`load_model` -- load a supported checkpoint (local path or hub name) in eval mode.
- :func:`patch_model` -> :class:`MoEPatch` -- install a routing policy and live per-layer expert caches at
  each MoE layer's router seam; read ``stats()`` and ``trace()``; ``unpatch()``.
- :mod:`expertcache.models.adapters` -- ``FAMILIES``: one declaration per model type (router seam, ranking
  input, weight formula, on-disk layout, tiny test configs).
- :mod:`expertcache.models.tiny` -- tiny random models of every supported family, for tests.
- :mod:`expertcache.models.captured` -- the captured decode step (static KV cache, a token's whole step one
  ``torch.compile`` graph, the MoE blocks opaque operators inside it; ``--compile``).

Supported ``model_type`` values: olmoe, mixtral, qwen2_moe (Qwen1.5-MoE), qwen3_moe, deepseek_v2 (incl.
V2-Lite), deepseek_v3, phimoe, gpt_oss.
"""

from expertcache.models.adapters import FAMILIES, SUPPORTED_MODEL_TYPES, family_for, find_moe_layers
from expertcache.models.loader import load_model
from expertcache.models.patch import BETWEEN_SEQUENCES, SCOPES, MoEPatch, patch_model

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "family_for", "find_moe_layers", "load_model", "patch_model",
           "MoEPatch", "SCOPES", "BETWEEN_SEQUENCES"]

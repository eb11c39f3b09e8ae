"""Offloaded MoE inference: experts on a slow tier (flash/SSD or host RAM), a fixed number of fast-tier
slots per layer, cache-aware routing against the live residency.

- :mod:`~expertcache.offload.checkpoint` -- safetensors headers and expert byte ranges, read by key;
- :mod:`~expertcache.offload.store` -- the disk tier (O_DIRECT / fadvise / cached) and the host-RAM tier;
- :mod:`~expertcache.offload.quant` -- group-wise int8 / 4-bit experts;
- :mod:`~expertcache.offload.budget` -- memory budget → slots per layer (everything the runtime allocates);
- :mod:`~expertcache.offload.config` -- :class:`OffloadConfig` (defaults);
- :mod:`~expertcache.offload.ioqueue` -- reader threads moving bytes (no policy);
- :mod:`~expertcache.offload.slots` -- page-aligned slots of one layer and what each holds;
- :mod:`~expertcache.offload.experts` -- views of a slot and the family's expert MLP;
- :mod:`~expertcache.offload.loader` -- the non-expert weights, by key;
- :mod:`~expertcache.offload.prefetch` -- next-layer guesses and their precision / recall;
- :mod:`~expertcache.offload.runtime` -- :class:`OffloadedModel` (construction, routing, generation);
  :mod:`~expertcache.offload.step` -- its per-layer cache step (bookkeeping, reads in flight, the guess);
- :mod:`~expertcache.offload.bench` -- decode-throughput benchmark against the physical floor;
- :mod:`~expertcache.offload.make_model` -- random-weight checkpoints at published shapes.
"""

from expertcache.offload.budget import BudgetError, MemoryPlan, parse_bytes, plan_memory
# every registered family declares its disk layout (models/adapters.py: Family.disk), so every one offloads
from expertcache.models.adapters import SUPPORTED_MODEL_TYPES as OFFLOAD_MODEL_TYPES
from expertcache.offload.checkpoint import Checkpoint, CheckpointError, read_header
from expertcache.offload.config import OffloadConfig
from expertcache.offload.runtime import OffloadedModel, resolve_model_path

__all__ = ["BudgetError", "MemoryPlan", "parse_bytes", "plan_memory", "OFFLOAD_MODEL_TYPES", "Checkpoint",
           "CheckpointError", "read_header", "OffloadConfig", "OffloadedModel", "resolve_model_path"]

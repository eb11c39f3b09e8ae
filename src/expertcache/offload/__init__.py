"""Offloaded MoE inference: experts on a slow tier (flash/SSD or host RAM), a fixed number of fast-tier
slots per layer, cache-aware routing against the live residency.

- :mod:`~expertcache.offload.checkpoint` -- safetensors headers and expert byte ranges, read by key;
- :mod:`~expertcache.offload.store` -- the disk tier (O_DIRECT / fadvise / cached) and the host-RAM tier;
- :mod:`~expertcache.offload.quant` -- group-wise int8 / 4-bit experts;
- :mod:`~expertcache.offload.budget` -- memory budget → slots per layer;
- :mod:`~expertcache.offload.runtime` -- :class:`OffloadedModel` (the offloaded MoE layer, generation);
- :mod:`~expertcache.offload.bench` -- decode-throughput benchmark with the I/O roofline;
- :mod:`~expertcache.offload.make_model` -- random-weight checkpoints at published shapes.
"""

from expertcache.offload.budget import BudgetError, MemoryPlan, parse_bytes, plan_memory
from expertcache.offload.checkpoint import OFFLOAD_MODEL_TYPES, Checkpoint, CheckpointError, read_header
from expertcache.offload.runtime import OffloadConfig, OffloadedModel, resolve_model_path

__all__ = ["BudgetError", "MemoryPlan", "parse_bytes", "plan_memory", "OFFLOAD_MODEL_TYPES", "Checkpoint",
           "CheckpointError", "read_header", "OffloadConfig", "OffloadedModel", "resolve_model_path"]

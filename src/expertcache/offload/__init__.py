"""Offloaded MoE inference: experts on a slow tier (flash/SSD or host RAM), a fixed number of fast-tier
slots per layer, cache-aware routing against the live residency. Parts, bottom to top (docs/ARCHITECTURE.md):

- :mod:`~expertcache.offload.checkpoint` -- expert byte ranges in a safetensors checkpoint, read by key;
- :mod:`~expertcache.offload.layout` -- where an expert's bytes go in a slot, views of a slot, the products;
- :mod:`~expertcache.offload.store` / :mod:`~expertcache.offload.tiers` / :mod:`~expertcache.offload.lowtier` --
  expert sources and sidecars, the disk and host-RAM tiers, the host cache level, the resident int4 copies;
- :mod:`~expertcache.offload.quant` / :mod:`~expertcache.offload.qlinear` -- int8 / 4-bit experts and dense layers;
- :mod:`~expertcache.offload.slots` -- the page-aligned slot arena and what each slot holds;
- :mod:`~expertcache.offload.ioqueue` / :mod:`~expertcache.offload.reads` -- reader threads; the reads into slots;
- :mod:`~expertcache.offload.views` -- an expert's tensors in its slot, kept;
- :mod:`~expertcache.offload.observe` -- observers and their events;
- :mod:`~expertcache.offload.step` -- one layer's cache step (bookkeeping, reads in flight, compute, the guess);
- :mod:`~expertcache.offload.routes` -- the routing policy against the live residency, the host's copies;
- :mod:`~expertcache.offload.capture` -- the captured decode step's seams;
- :mod:`~expertcache.offload.preflight` / :mod:`~expertcache.offload.budget` -- memory plan → slots per layer;
- :mod:`~expertcache.offload.generate` / :mod:`~expertcache.offload.stats` -- the decode loop; the counters;
- :mod:`~expertcache.offload.runtime` -- :class:`OffloadedModel`, assembling the parts into the HF model;
- :mod:`~expertcache.offload.config` (defaults), :mod:`~expertcache.offload.loader` (non-expert weights),
  :mod:`~expertcache.offload.prefetch` (next-layer guesses), :mod:`~expertcache.offload.bench`,
  :mod:`~expertcache.offload.make_model` (random-weight checkpoints at published shapes).
"""

from expertcache.offload.budget import BudgetError, MemoryPlan, parse_bytes, plan_memory
# every registered family declares its disk layout (models/adapters.py: Family.disk), so every one offloads
from expertcache.models.adapters import SUPPORTED_MODEL_TYPES as OFFLOAD_MODEL_TYPES
from expertcache.offload.checkpoint import Checkpoint, CheckpointError, read_header
from expertcache.offload.config import OffloadConfig
from expertcache.offload.runtime import OffloadedModel, resolve_model_path

__all__ = ["BudgetError", "MemoryPlan", "parse_bytes", "plan_memory", "OFFLOAD_MODEL_TYPES", "Checkpoint",
           "CheckpointError", "read_header", "OffloadConfig", "OffloadedModel", "resolve_model_path"]

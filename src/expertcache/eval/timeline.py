"""Per-token cache events of recorded selections: which requests hit or missed, and what was resident.

The simulator's :func:`expertcache.sim.replay` returns totals; these helpers replay the same selections
step by step (same caches, same step semantics, so the totals agree) and keep the per-token detail, for
generation-only miss rates and the hit/miss raster (001 Fig. 7).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from expertcache.cache import DEFAULT_GAMMA, make_cache, resolve_capacity
from expertcache.sim.simulator import sequence_segments

__all__ = ["step_misses", "layer_raster", "RASTER_IDLE", "RASTER_RESIDENT", "RASTER_HIT", "RASTER_MISS"]

RASTER_IDLE, RASTER_RESIDENT, RASTER_HIT, RASTER_MISS = 0, 1, 2, 3


def step_misses(ids_TLK: np.ndarray, num_experts: int, capacity, *, eviction: str = "lru", gamma: float = DEFAULT_GAMMA,
                initial: str | Iterable[int] | None = None, seed: int = 0,
                sequence_starts: Sequence[int] | None = None, between_sequences: str = "carry") -> np.ndarray:
    """int32 [T, L]: misses of every token at every layer when ``ids_TLK`` (descending weight, -1 = dropped)
    is served by one ``eviction`` cache per layer (fresh per sequence with ``between_sequences='reset'``).
    ``step_misses(...).sum()`` equals ``replay(...).overall.misses`` for the same arguments."""
    ids_TLK = np.asarray(ids_TLK)
    t, n_l, _ = ids_TLK.shape
    cap = resolve_capacity(capacity, num_experts)
    out = np.zeros((t, n_l), dtype=np.int32)
    for layer in range(n_l):
        for a, b in sequence_segments(t, sequence_starts, between_sequences):
            cache = make_cache(eviction, num_experts, cap, initial=initial, seed=seed + layer, gamma=gamma)
            for i, ids in enumerate(ids_TLK[a:b, layer].tolist(), start=a):
                hits = cache.access_step(ids)
                out[i, layer] = sum(1 for e, h in zip(ids, hits) if e >= 0 and not h)
    return out


def layer_raster(ids_TK: np.ndarray, num_experts: int, capacity, *, eviction: str = "lru", gamma: float = DEFAULT_GAMMA,
                 initial: str | Iterable[int] | None = None, seed: int = 0) -> np.ndarray:
    """int8 [T, E] events of one layer's cache over T consecutive tokens: ``RASTER_HIT`` / ``RASTER_MISS`` for
    the experts a token requested, ``RASTER_RESIDENT`` for experts resident before the token but not
    requested, ``RASTER_IDLE`` otherwise (001 Fig. 7: green, red, blue, white)."""
    ids_TK = np.asarray(ids_TK)
    cap = resolve_capacity(capacity, num_experts)
    cache = make_cache(eviction, num_experts, cap, initial=initial, seed=seed, gamma=gamma)
    out = np.zeros((ids_TK.shape[0], num_experts), dtype=np.int8)
    for i, ids in enumerate(ids_TK.tolist()):
        out[i, np.array(cache.resident_mask(), dtype=bool)] = RASTER_RESIDENT
        for e, hit in zip(ids, cache.access_step(ids)):
            if e >= 0:
                out[i, e] = RASTER_HIT if hit else RASTER_MISS
    return out

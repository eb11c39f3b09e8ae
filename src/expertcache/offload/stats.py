"""What the offloaded runtime did: its counters gathered from its parts, and the recorded routing for replay.

Functions of the parts (:class:`~expertcache.offload.step.CacheSteps`, :class:`~expertcache.offload.reads.SlotReads`,
the tier and the host cache level); they change nothing but wait for reads in flight, so counts are final.
"""

from __future__ import annotations

import functools

import numpy as np

from expertcache.cache import CacheStats
from expertcache.offload.reads import SlotReads
from expertcache.offload.step import CacheSteps, LayerState

__all__ = ["runtime_stats", "recorded_ids"]


def runtime_stats(steps: CacheSteps, reads: SlotReads, tier, host) -> dict:
    """Hits (full precision), misses (loads), ``low_computes`` (misses computed from the resident
    low-precision copies instead, ``--resident-quant``; not in accesses), hit rate, bytes read from the tier
    (demand misses and prefetches), reads, read seconds (summed over reader threads), seconds the compute thread
    waited for reads, compute seconds, prefetch counters (:class:`~expertcache.offload.prefetch.PrefetchStats`);
    ``tiers``: where each access was served (fast slot, host-RAM cache, disk) with a host cache ``host``."""
    for t in steps.arena.tickets():
        t.join()
    reads.resolve_stalls()  # GPU: the device-side copy waits, timed by CUDA events
    states = steps.states
    per = [st.cache.finish() for st in states]
    total = functools.reduce(CacheStats.merge, per)
    counts = host.counts if host is not None else None
    tiers = None
    if counts is not None:
        tiers = dict(fast_hits=total.hits, **counts.to_dict(), host_slots=host.slots, host_budget=host.budget)
    return dict(accesses=total.accesses, hits=total.hits, misses=total.misses, hit_rate=total.hit_rate,
                evictions=total.evictions,
                bytes_read=tier.stats.bytes_read + (counts.host_bytes if counts else 0),
                expert_loads=tier.stats.loads + (counts.host_hits if counts else 0),
                io_seconds=tier.stats.seconds + (counts.host_busy_seconds if counts else 0.0), tiers=tiers,
                io_wait_seconds=reads.io_wait_seconds, compute_seconds=steps.compute_seconds,
                prefetched=sum(st.prefetched for st in states), prefetch=steps.prefetch_stats.to_dict(),
                low_computes=sum(st.low_computes for st in states),
                per_layer_misses=[s.misses for s in per],
                per_layer_low_computes=[st.low_computes for st in states],
                per_layer_io_wait_seconds=[st.io_wait for st in states])


def recorded_ids(states: list[LayerState], top_k: int) -> np.ndarray:
    """[T, L, K] ids of the recorded single-token steps (``LayerState.steps``; -1 pads a step of fewer than
    ``top_k`` experts), for :func:`expertcache.sim.replay`. RuntimeError if the layers recorded different counts."""
    steps = [st.steps for st in states]
    n = {len(s) for s in steps}
    if len(n) != 1:
        raise RuntimeError(f"layers recorded different step counts {sorted(n)}")
    t = n.pop()
    out = np.full((t, len(steps), top_k), -1, dtype=np.int32)
    for li, s in enumerate(steps):
        for ti, ids in enumerate(s):
            out[ti, li, :len(ids)] = ids
    return out

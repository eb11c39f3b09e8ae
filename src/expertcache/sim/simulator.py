"""The cache simulator: replays routing traces through per-layer expert caches.

Two modes:

- :func:`replay` -- fixed selections ``ids_TLK`` (what a model actually chose) through one cache per
  layer. This is how live runs are checked (same counts) and how the Belady bound is computed.
- :func:`simulate` -- **open loop**: re-routes every token of a trace with a routing policy against the
  live residency of the simulated caches. The logits are fixed: a re-ranked selection does not feed back
  into later hidden states (and so into later logits), unlike a real (closed-loop) run of the patched
  model (``expertcache.models``). Open-loop miss rates are therefore estimates; closed-loop runs are the
  reference for quality.

Miss rates follow 001 Eq. 4: misses / (steps × K) per layer, so a policy that loads fewer than K experts
(the pruning baseline) is normalised by K. Layers are independent (one cache each).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from expertcache import __version__
from expertcache.cache import DEFAULT_GAMMA, CacheStats, eviction_rule, make_cache, resolve_capacity

__all__ = ["SimResult", "replay", "simulate", "activation_frequency"]


@dataclass
class SimResult:
    """Per-layer and whole-model cache statistics of one simulated run (results as data)."""

    per_layer: list[CacheStats]
    top_k: int
    config: dict[str, Any] = field(default_factory=dict)
    belady_per_layer: list[CacheStats] | None = None
    ids_TLK: np.ndarray | None = None  # the selections served (open loop: after re-ranking)
    seconds: float = 0.0

    @property
    def overall(self) -> CacheStats:
        out = self.per_layer[0]
        for s in self.per_layer[1:]:
            out = out.merge(s)
        return out

    @staticmethod
    def _rate(stats: Sequence[CacheStats], k: int) -> float:
        steps = sum(s.steps for s in stats)
        return sum(s.misses for s in stats) / (steps * k) if steps else 0.0

    @property
    def miss_rate(self) -> float:
        """Whole-model miss rate, misses / (tokens × layers × K)."""
        return self._rate(self.per_layer, self.top_k)

    def layer_miss_rates(self) -> list[float]:
        return [self._rate([s], self.top_k) for s in self.per_layer]

    @property
    def belady_miss_rate(self) -> float | None:
        return None if self.belady_per_layer is None else self._rate(self.belady_per_layer, self.top_k)

    def to_row(self) -> dict[str, Any]:
        """One JSON-serialisable row: full config, version, metrics (overall and per layer)."""
        ov = self.overall
        row = {
            "version": __version__,
            "config": self.config,
            "miss_rate": self.miss_rate,
            "hit_rate": 1.0 - self.miss_rate,
            "mean_lifetime": _clean(ov.mean_lifetime),
            "std_lifetime": _clean(ov.std_lifetime),
            "accesses": ov.accesses,
            "misses": ov.misses,
            "tokens": self.per_layer[0].steps if self.per_layer else 0,
            "bytes_loaded": ov.bytes_loaded,
            "layer_miss_rates": self.layer_miss_rates(),
            "layer_mean_lifetimes": [_clean(s.mean_lifetime) for s in self.per_layer],
            "seconds": self.seconds,
        }
        if self.belady_per_layer is not None:
            row["belady_miss_rate"] = self.belady_miss_rate
            row["belady_layer_miss_rates"] = [self._rate([s], self.top_k) for s in self.belady_per_layer]
        return row


def _clean(x: float) -> float | None:
    return None if x != x else x  # NaN -> None for JSON


def check_selections(ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """``ids_TLK`` as an array, checked to be [T, L, K] with ids in [-1, num_experts) (ValueError otherwise)."""
    ids_TLK = np.asarray(ids_TLK)
    if ids_TLK.ndim != 3:
        raise ValueError(f"selections must be [T, L, K], got shape {ids_TLK.shape}")
    if ids_TLK.size and (ids_TLK.min() < -1 or ids_TLK.max() >= num_experts):
        raise ValueError(f"expert ids must be in [-1, {num_experts})")
    return ids_TLK


def replay(
    ids_TLK: np.ndarray,
    num_experts: int,
    capacity: int | float | str,
    *,
    eviction: str = "lru",
    gamma: float = DEFAULT_GAMMA,
    initial: str | Iterable[int] | None = None,
    seed: int = 0,
    expert_bytes: int | Sequence[int] | None = None,
    sequence_starts: Sequence[int] | None = None,
    between_sequences: str = "carry",
) -> SimResult:
    """Replay fixed selections ``ids_TLK`` ([T, L, K], ids ordered by descending weight, -1 = dropped)
    through one cache per layer. ``between_sequences='reset'`` starts a fresh cache at every index in
    ``sequence_starts``; 'carry' keeps the cache across sequences."""
    t0 = time.perf_counter()
    ids_TLK = check_selections(ids_TLK, num_experts)
    cap = resolve_capacity(capacity, num_experts)
    segments = sequence_segments(ids_TLK.shape[0], sequence_starts, between_sequences)
    per_layer = []
    for layer in range(ids_TLK.shape[1]):
        total = None
        for a, b in segments:
            steps = ids_TLK[a:b, layer, :]
            cache = make_cache(eviction, num_experts, cap, initial=initial, seed=seed + layer, gamma=gamma,
                               future=steps.tolist() if eviction_rule(eviction).offline else None,
                               expert_bytes=expert_bytes)
            cache.serve_array(steps)
            stats = cache.finish()
            total = stats if total is None else total.merge(stats)
        per_layer.append(total)
    config = dict(mode="replay", eviction=eviction, capacity=cap, num_experts=num_experts, gamma=gamma,
                  initial=_initial_label(initial), seed=seed, between_sequences=between_sequences)
    return SimResult(per_layer, top_k=ids_TLK.shape[2], config=config, ids_TLK=ids_TLK,
                     seconds=time.perf_counter() - t0)


def sequence_segments(t: int, starts: Sequence[int] | None, mode: str) -> list[tuple[int, int]]:
    """The [a, b) token ranges that each get fresh caches: the whole run with ``mode='carry'``, one per
    sequence with ``'reset'``."""
    if mode not in ("carry", "reset"):
        raise ValueError(f"between_sequences must be 'carry' or 'reset', got {mode!r}")
    if mode == "carry" or not starts:
        return [(0, t)]
    s = list(starts)
    return [(a, b) for a, b in zip(s, s[1:] + [t]) if b > a]


def _initial_label(initial) -> Any:
    if initial is None or isinstance(initial, str):
        return initial or "empty"
    return sorted(int(e) for e in initial)


def selection_counts(ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] int64: how often each expert is selected at each layer (dropped slots ignored; ids checked)."""
    ids_TLK = check_selections(ids_TLK, num_experts)
    counts_LE = np.zeros((ids_TLK.shape[1], num_experts), dtype=np.int64)
    for layer, ids in enumerate(ids_TLK.transpose(1, 0, 2).reshape(ids_TLK.shape[1], -1)):
        counts_LE[layer] = np.bincount(ids[ids >= 0], minlength=num_experts)
    return counts_LE


def activation_frequency(ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """Per-layer normalised activation frequency [L, E] (003 Sec. III-A): the share of selections that go
    to each expert (rows sum to 1; uniform routing gives 1/E). Used by ERAS biasing."""
    freq = selection_counts(ids_TLK, num_experts).astype(np.float64)
    totals = freq.sum(axis=1, keepdims=True)
    return (freq / np.where(totals == 0, 1, totals)).astype(np.float32)


def simulate(
    trace,
    routing,
    capacity: int | float | str,
    *,
    eviction: str = "lru",
    gamma: float = DEFAULT_GAMMA,
    initial: str | Iterable[int] | None = None,
    seed: int = 0,
    belady: bool = False,
    freq_LE: np.ndarray | None = None,
    between_sequences: str = "carry",
    expert_bytes: int | Sequence[int] | None = None,
    progress: bool = False,
    router_hook=None,
) -> SimResult:
    """Open-loop simulation of ``routing`` (a :class:`~expertcache.routing.RoutingConfig`) on ``trace``
    (a :class:`~expertcache.trace.RoutingTrace`).

    ``original`` replays the recorded selections; ``prune`` drops their ranks ≥ h; cache-aware policies
    re-rank each token's recorded logits against the current residency (token by token, since residency
    changes after every token) using the trace's scoring and renormalisation. With ``belady=True`` the
    selections served are also replayed under Belady's optimal eviction (the offline bound for the same
    selections). ``eras-bias`` needs ``freq_LE`` (see :func:`activation_frequency`). ``router_hook(router)``
    may replace the cache-aware policy's Router (budget-targeted routing: :func:`expertcache.routing.budget.wrap`).
    """
    import torch

    from expertcache.routing import Router

    t0 = time.perf_counter()
    meta = trace.meta
    n, k = meta.num_experts, meta.top_k
    cap = resolve_capacity(capacity, n)
    segments = sequence_segments(trace.num_tokens, meta.sequence_starts, between_sequences)
    replay_kw = dict(initial=initial, seed=seed, expert_bytes=expert_bytes, sequence_starts=meta.sequence_starts,
                     between_sequences=between_sequences)  # of both replays below
    if routing.policy in ("original", "prune"):  # fixed selections (prune: ranks ≥ h dropped)
        served = np.asarray(trace.ids_TLK)
        if routing.policy == "prune":
            h = k if routing.h is None else routing.h
            if not 1 <= h <= k:
                raise ValueError(f"prune h must be in [1, K={k}], got h={h}")
            served = served.astype(np.int64)
            served[:, :, h:] = -1
        per_layer = replay(served, n, cap, eviction=eviction, gamma=gamma, **replay_kw).per_layer
    else:
        if eviction_rule(eviction).offline:
            raise ValueError(f"{eviction}: Belady needs the future selections, which a cache-aware policy only decides "
                             "as it goes; simulate with lru/lfu/gamma and pass belady=True for the bound")
        freq = None if freq_LE is None else torch.as_tensor(np.asarray(freq_LE), dtype=torch.float32)
        router = Router(routing, num_experts=n, k=k, renormalize=meta.renormalize, scoring=meta.scoring,
                        freq_LE=freq)
        if router_hook is not None:  # e.g. budget-targeted routing (expertcache.routing.budget.wrap)
            router = router_hook(router)
        logits = torch.from_numpy(np.asarray(trace.logits_TLE, dtype=np.float32))
        served = np.empty(trace.ids_TLK.shape, dtype=np.int64)
        num_layers = trace.num_layers
        layer_ids = list(range(num_layers))
        totals: list[CacheStats | None] = [None] * num_layers
        from tqdm import tqdm

        bar = tqdm(total=trace.num_tokens, desc=f"simulate {routing.label()}", unit="tok", disable=not progress)
        for a, b in segments:
            caches = [make_cache(eviction, n, cap, initial=initial, seed=seed + layer, gamma=gamma,
                                 expert_bytes=expert_bytes) for layer in layer_ids]
            for t in range(a, b):
                # one call routes token t at every layer (rows = layers, each with its own residency)
                mask_LE = torch.tensor([c.resident_mask() for c in caches])
                ids_LK = router.route(layer_ids, logits[t], mask_LE).ids_TK.tolist()
                for cache, ids in zip(caches, ids_LK):
                    cache.access_step(ids)
                served[t] = ids_LK
                bar.update(1)
            for layer, cache in enumerate(caches):
                stats = cache.finish()
                totals[layer] = stats if totals[layer] is None else totals[layer].merge(stats)
        bar.close()
        per_layer = totals
    belady_per_layer = replay(served, n, cap, eviction="belady", **replay_kw).per_layer if belady else None
    config = dict(mode="open-loop", trace_model=meta.model, trace_source=meta.source,
                  tokens=trace.num_tokens, num_experts=n, top_k=k, routing=routing.to_dict(),
                  eviction=eviction, capacity=cap, gamma=gamma, initial=_initial_label(initial), seed=seed,
                  between_sequences=between_sequences)
    return SimResult(per_layer, top_k=k, config=config, belady_per_layer=belady_per_layer, ids_TLK=served,
                     seconds=time.perf_counter() - t0)

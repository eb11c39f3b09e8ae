"""The cache-aware policies as functions of (logits [T, E], residency [E] or [T, E], K, hyper-parameters), for
the tests written against the papers' formulas: each builds a :class:`expertcache.routing.Router` for one layer
and ranks with it, so they run the one implementation (the policy kernels) and its validation."""

from __future__ import annotations

import torch

from expertcache.routing import DeltaAvg, Router, RoutingConfig


def _rank(cfg: RoutingConfig, z, resident, k, *, scoring="softmax", freq_LE=None, layer=0, delta=None):
    router = Router(cfg, num_experts=z.shape[-1], k=k, renormalize=False, scoring=scoring, freq_LE=freq_LE)
    if delta is not None:
        router.deltas[layer] = delta  # a running Δavg the caller keeps: advanced token by token, in place
    return router.rank(layer, z, resident)


def max_rank_rank(z, resident, k, m, j=1):
    return _rank(RoutingConfig("max-rank", m=m, top_j=j), z, resident, k)


def cumsum_threshold_rank(z, resident, k, p, j=1, *, scoring="softmax"):
    return _rank(RoutingConfig("cumsum", p=p, top_j=j), z, resident, k, scoring=scoring)


def cache_prior_rank(z, resident, k, lam, j=1, *, delta):
    """``delta``: Δavg as a number, a [T] tensor (one fixed value per row) or a :class:`DeltaAvg` (a running
    one is advanced token by token)."""
    if isinstance(delta, torch.Tensor):
        res = resident.expand_as(z)
        return torch.cat([cache_prior_rank(z[t:t + 1], res[t:t + 1], k, lam, j, delta=float(d))
                          for t, d in enumerate(delta.reshape(-1).tolist())])
    if isinstance(delta, DeltaAvg):
        if delta.fixed is None:
            return _rank(RoutingConfig("cache-prior", lam=lam, top_j=j), z, resident, k, delta=delta)
        delta = delta.fixed
    return _rank(RoutingConfig("cache-prior", lam=lam, top_j=j, delta=float(delta)), z, resident, k)


def eras_threshold_rank(z, resident, k, alpha, j=0, *, scoring="softmax"):
    return _rank(RoutingConfig("eras-threshold", alpha=alpha, top_j=j), z, resident, k, scoring=scoring)


def eras_bias_rank(z, resident, k, beta, freq_E, j=0):
    """``freq_E``: the layer's profile [E], or one profile per row [T, E]."""
    cfg = RoutingConfig("eras-bias", beta=beta, top_j=j)
    if freq_E.dim() == 2 and freq_E.shape[0] == z.shape[0]:
        return _rank(cfg, z, resident, k, freq_LE=freq_E.float(), layer=list(range(z.shape[0])))
    return _rank(cfg, z, resident, k, freq_LE=freq_E.float().reshape(1, -1))

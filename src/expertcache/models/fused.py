"""One kernel call per layer call for a cache-aware policy against a live cache (used by the patch).

For P tokens of one layer, token by token: the policy's keys (:func:`expertcache.routing.kernels.token_keys`),
the selection against the cache's current residency (:func:`expertcache.routing.kernels.select`) and the
serving (:func:`expertcache.cache.base.serve_one`). No decision is made here: this only drives the three
kernels in one loop, so that decoding pays one call overhead per layer instead of several. The combine
weights of the selection come from the family's torch rule (:mod:`expertcache.models.adapters`), which
must match transformers bit for bit and so is not repeated in the loop.
"""

from __future__ import annotations

import numpy as np
import torch

from expertcache.cache import ExpertCache
from expertcache.cache import base as _cache
from expertcache.compiled import jit_each
from expertcache.routing import Router
from expertcache.routing import kernels as rk

__all__ = ["keyed_serve"]

# The loop below inlines functions of routing/kernels.py and cache/base.py; its disk cache is keyed by those files
# too (expertcache.compiled: the digest of every module this one imports), so an edit there recompiles it.


def _keyed_serve_for(code):
    def _keyed_serve(zr_PE, z_PE, prob_PE, ip, fp, penalty_PE, allowed_PE, k, out_PK, st_E, score_E, st_S, pf):
        p_count, e = zr_PE.shape
        order = np.empty(e, np.int64)
        kres = np.empty(e, np.float32)
        knon = np.empty(e, np.float32)
        bk = np.empty(k, np.float32)
        bp = np.empty(k, np.int64)
        ids = np.empty(k, np.int64)
        miss_buf = np.empty(k, np.int64)
        nxt = np.zeros(k, np.int64)
        for p in range(p_count):
            if rk.token_keys(zr_PE[p], prob_PE[min(p, prob_PE.shape[0] - 1)], ip, fp, penalty_PE[0],
                             allowed_PE[min(p, allowed_PE.shape[0] - 1)], order, kres, knon) != rk.OK:
                return p
            rk.select(order, kres, knon, z_PE[p], k, st_E[0], bk, bp, ids)
            for i in range(k):
                out_PK[p, i] = ids[i]
            _cache.serve_one(ids, k, nxt, code, st_E, score_E, st_S, pf, miss_buf)
        return p_count
    return _keyed_serve


# one compiled loop per eviction code (a compile-time constant there), from the one source above
_KEYED_SERVE = jit_each(_keyed_serve_for, _cache.CODES)


def keyed_serve(router: Router, layer: int, zr_PE: torch.Tensor, z_PE: torch.Tensor, allowed_PE: torch.Tensor | None,
                cache: ExpertCache) -> np.ndarray | None:
    """Select and serve P tokens of one row in one kernel call: ids int64 [P, K] in descending-logit order.

    ``zr_PE``: the ranking values (``Family.ranking``); ``allowed_PE``: the experts the model allows (an
    expert outside is keyed as not resident); ``z_PE``: the logits (serving order). ValueError for a NaN
    logit. None (nothing served) when the router has no kernel parameters (a wrapper such as
    :class:`expertcache.routing.budget.BudgetRouter`, whose strength moves per token)."""
    params = router.kernel_params(layer, allowed=allowed_PE is not None)
    if params is None:  # a router that decides token by token through rank (routing.budget.BudgetRouter)
        return None
    zr = zr_PE.detach().to("cpu", torch.float32)
    probs = router.probs(zr)
    params.load()
    out_PK = np.empty((zr.shape[0], router.k), np.int64)
    z = np.ascontiguousarray((zr if z_PE is zr_PE else z_PE.detach().to("cpu", torch.float32)).numpy())
    done = _KEYED_SERVE[cache.code](zr.numpy(), z, rk.EMPTY_F if probs is None else probs, params.ip, params.fp,
                                    rk.EMPTY_F if params.penalty is None else params.penalty,
                                    rk.EMPTY_B if allowed_PE is None else allowed_PE.numpy(), router.k, out_PK,
                                    cache.st_E, cache.score_E, cache.st_S, cache.pf)
    params.store()
    cache.kernel_served()
    if done < zr.shape[0]:
        raise ValueError("router logits contain NaN")
    return out_PK

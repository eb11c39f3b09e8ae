"""One compiled call per layer call for a cache-aware policy against a live LRU cache (used by the patch).

For P tokens of one layer, token by token: the policy's keys (:func:`expertcache.routing.kernels.token_keys`),
the selection against the cache's current residency and the serving
(:func:`expertcache.cache.kernels.select_one`, :func:`~expertcache.cache.kernels.serve_one`). Routing and
cache bookkeeping stay in their own modules; this only drives them in one loop, so that decoding pays one
compiled-call overhead per layer instead of several. Same decisions as ``Router.keys`` followed by
``LRUCache.select_serve`` (and so as ``Router.rank`` + ``access_step`` token by token; pinned by tests).
"""

from __future__ import annotations

import numpy as np
import torch

from expertcache.cache import LRUCache
from expertcache.cache import kernels as ck
from expertcache.routing import Router
from expertcache.routing import kernels as rk

__all__ = ["AVAILABLE", "keyed_serve"]

AVAILABLE = ck.AVAILABLE and rk.AVAILABLE


#: sha256 (first 16 hex digits) of routing/kernels.py + cache/kernels.py, whose functions the loop below inlines.
#: numba's on-disk cache only notices edits to *this* file, so an edit there must change this line (a test
#: checks it); otherwise a stale compiled loop would be loaded.
_DEPENDS_ON = "4bdeb09bed6f183c"


def kernel_sources_digest() -> str:
    """The digest _DEPENDS_ON must equal (see there)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = (root / "routing" / "kernels.py").read_bytes() + (root / "cache" / "kernels.py").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _jit(fn):
    import numba

    return numba.njit(cache=True, nogil=True)(fn)


if AVAILABLE:
    @_jit
    def _keyed_serve(zr_PE, z_PE, ip, fp, penalty_E, allowed_PE, k, out_PK, lru_E, lru_S):
        p_count, e = zr_PE.shape
        order = np.empty(e, np.int64)
        tmp = np.empty(e, np.int64)
        kres = np.empty(e, np.float32)
        knon = np.empty(e, np.float32)
        bk = np.empty(k, np.float32)
        bp = np.empty(k, np.int64)
        ids = np.empty(k, np.int64)
        miss_buf = np.empty(k, np.int64)
        for p in range(p_count):
            if rk.token_keys(zr_PE[p], ip, fp, penalty_E, allowed_PE[p if ip[4] else 0], order, kres, knon,
                             tmp) != rk.OK:
                return p
            ck.select_one(order, kres, knon, z_PE[p], k, lru_E[0], bk, bp, ids)
            for i in range(k):
                out_PK[p, i] = ids[i]
            ck.serve_one(ids, k, lru_E, lru_S, miss_buf)
        return p_count


_NO_ALLOWED = np.zeros((1, 1), np.bool_)


def keyed_serve(router: Router, layer: int, zr_PE: torch.Tensor, z_PE: torch.Tensor, allowed_PE: torch.Tensor | None,
                cache) -> tuple[np.ndarray, int] | None:
    """Select and serve P tokens in one compiled call: ``(ids int64 [P, K], done)`` where rows ``< done`` are
    selected and served (descending-logit order) and token ``done`` (if < P) must go the per-token way (a tie
    at the top-J boundary or a non-finite logit); None when this path does not apply (no numba, not an LRU
    cache with integer byte costs, a policy without compiled keys, logits not float32 on the CPU)."""
    if not AVAILABLE or type(cache) is not LRUCache or not cache._compiled():
        return None
    if zr_PE.dtype != torch.float32 or z_PE.dtype != torch.float32 or zr_PE.device.type != "cpu":
        return None
    params = router.kernel_params(layer, allowed=allowed_PE is not None)
    if params is None:
        return None
    ip, fp, penalty_E = params
    a = cache._own_arrays()
    k = router.k
    out_PK = np.empty((zr_PE.shape[0], k), np.int64)
    done = _keyed_serve(zr_PE.numpy(), z_PE.numpy(), ip, fp, penalty_E,
                        _NO_ALLOWED if allowed_PE is None else allowed_PE.numpy(), k, out_PK, a.lru_E, a.lru_S)
    router.commit_kernel_delta(layer, fp)
    return out_PK, int(done)

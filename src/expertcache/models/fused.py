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
from expertcache.compiled import jit, jit_inline
from expertcache.cache import kernels as ck
from expertcache.routing import Router
from expertcache.routing import kernels as rk

__all__ = ["AVAILABLE", "COMPILED_POLICIES", "keyed_serve", "weight_rule_array"]

AVAILABLE = ck.AVAILABLE and rk.AVAILABLE
#: policies whose keys the loop computes itself (the others select and serve compiled via Router.keys)
COMPILED_POLICIES = tuple(rk.CODES)


#: sha256 (first 16 hex digits) of routing/kernels.py + cache/kernels.py, whose functions the loop below inlines.
#: numba's on-disk cache only notices edits to *this* file, so an edit there must change this line (a test
#: checks it); otherwise a stale compiled loop would be loaded.
_DEPENDS_ON = "fc763c5169823914"


def kernel_sources_digest() -> str:
    """The digest _DEPENDS_ON must equal (see there)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    data = (root / "routing" / "kernels.py").read_bytes() + (root / "cache" / "kernels.py").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


if AVAILABLE:
    @jit
    def _keyed_serve(zr_PE, z_PE, ip, fp, penalty_E, allowed_PE, k, out_PK, lru_E, lru_S, wr, w_PK, ids0_PK, w0_PK):
        p_count, e = zr_PE.shape
        order = np.empty(e, np.int64)
        tmp = np.empty(e, np.int64)
        zbuf = np.empty(e, np.float32)
        kres = np.empty(e, np.float32)
        knon = np.empty(e, np.float32)
        bk = np.empty(k, np.float32)
        bp = np.empty(k, np.int64)
        ids = np.empty(k, np.int64)
        miss_buf = np.empty(k, np.int64)
        for p in range(p_count):
            if rk.token_keys(zr_PE[p], ip, fp, penalty_E, allowed_PE[p if ip[4] else 0], order, kres, knon,
                             tmp, zbuf) != rk.OK:
                return p
            ck.select_one(order, kres, knon, z_PE[p], k, lru_E[0], bk, bp, ids)
            for i in range(k):
                out_PK[p, i] = ids[i]
            ck.serve_one(ids, k, lru_E, lru_S, miss_buf)
            if wr[0] != 0.0:
                if ids0_PK.shape[0] == p_count and _stock_weights(ids, k, ids0_PK[p], w0_PK[p], w_PK[p]):
                    continue  # the model's own choice: its own weights
                _weights(z_PE[p], ids, k, wr, w_PK[p])
        return p_count

    @jit_inline
    def _stock_weights(ids, k, ids0_K, w0_K, w_K):
        """If ``ids`` hold the same experts as the stock selection ``ids0_K``, write the stock weights in the
        order of ``ids`` and return True."""
        for i in range(k):
            found = False
            for j in range(k):
                if ids0_K[j] == ids[i]:
                    w_K[i] = w0_K[j]
                    found = True
                    break
            if not found:
                return False
        return True

    @jit_inline
    def _sparsemixer_slot(z_E, a, skip, thr2eps):
        """PhiMoE's eval-mode sparsemixer weight of expert ``a``: the softmax over the experts whose logit is
        within the relative threshold of ``z[a]`` (float32 test, as torch does it), ``skip`` (>= 0) excluded."""
        thr = z_E[a]
        mx = -np.inf
        for x in range(z_E.shape[0]):
            if x != skip:
                factor = max(abs(z_E[x]), thr)
                if not ((thr - z_E[x]) / factor > thr2eps) and z_E[x] > mx:
                    mx = np.float64(z_E[x])
        norm = 0.0
        for x in range(z_E.shape[0]):
            if x != skip:
                factor = max(abs(z_E[x]), thr)
                if not ((thr - z_E[x]) / factor > thr2eps):
                    norm += np.exp(np.float64(z_E[x]) - mx)
        return np.exp(np.float64(thr) - mx) / norm

    @jit_inline
    def _weights(z_E, ids, k, wr, w_K):
        """The family's weight rule at ``ids``: ``wr`` = [scoring (1 softmax, 2 sigmoid, 3 PhiMoE's
        sparsemixer), renorm, scale, eps (sparsemixer: its float32 threshold 2·jitter)]; float64, stored
        as float32."""
        if wr[0] == 3.0:  # slot 1 = ids[0]; slot 2 = ids[1] with slot 1 masked out (K = 2)
            thr2eps = np.float32(wr[3])
            w_K[0] = _sparsemixer_slot(z_E, ids[0], -1, thr2eps)
            w_K[1] = _sparsemixer_slot(z_E, ids[1], ids[0], thr2eps)
            return
        softmax = wr[0] == 1.0
        mx = 0.0
        norm = 1.0
        if softmax:
            mx = np.float64(z_E[ids[0]])
            for i in range(k):
                if z_E[ids[i]] > mx:
                    mx = np.float64(z_E[ids[i]])
            if wr[1] == 0.0:  # no renormalisation: the softmax over all E experts (renormalised, it cancels)
                mx32 = z_E[0]
                for x in range(z_E.shape[0]):
                    if z_E[x] > mx32:
                        mx32 = z_E[x]
                mx = np.float64(mx32)
                norm = 0.0
                for x in range(z_E.shape[0]):  # float32 exponentials (as torch's softmax), float64 sum
                    norm += np.float64(np.exp(z_E[x] - mx32))
        total = 0.0
        for i in range(k):
            v = np.float64(z_E[ids[i]])
            total += np.exp(v - mx) / norm if softmax else 1.0 / (1.0 + np.exp(-v))
        for i in range(k):
            v = np.float64(z_E[ids[i]])
            w = np.exp(v - mx) / norm if softmax else 1.0 / (1.0 + np.exp(-v))
            if wr[1] != 0.0:
                w = w / (total + wr[3])
            w_K[i] = w * wr[2]


_NO_ALLOWED = np.zeros((1, 1), np.bool_)


_NO_RULE = np.zeros(4, np.float64)
_NO_W = np.zeros((1, 1), np.float32)


_NO_IDS0 = np.zeros((0, 1), np.int64)


def _stock_arrays(stock) -> tuple[np.ndarray, np.ndarray]:
    if stock is None:
        return _NO_IDS0, _NO_W
    ids0, w0 = stock
    if (ids0.dtype != torch.int64 or w0.dtype != torch.float32 or ids0.device.type != "cpu"
            or w0.device.type != "cpu" or ids0.shape != w0.shape or ids0.dim() != 2):
        return _NO_IDS0, _NO_W
    return ids0.detach().numpy(), w0.detach().numpy()


def weight_rule_array(rule: tuple[str, bool, float, float] | None) -> np.ndarray | None:
    """A family's ``weight_rule`` as the float64 [4] the compiled loop takes (None stays None)."""
    if rule is None:
        return None
    scoring, renorm, scale, eps = rule
    return np.array([{"softmax": 1.0, "sigmoid": 2.0, "sparsemixer": 3.0}[scoring], float(renorm), float(scale),
                     float(eps)])


def keyed_serve(router: Router, layer: int, zr_PE: torch.Tensor, z_PE: torch.Tensor, allowed_PE: torch.Tensor | None,
                cache, weight_rule: np.ndarray | None = None, restrict: bool = False,
                stock: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[np.ndarray, int] | None:
    """Select and serve P tokens in one compiled call: ``(ids int64 [P, K], done)`` where rows ``< done`` are
    selected and served (descending-logit order) and token ``done`` (if < P) must go the per-token way (a tie
    at the top-J boundary or a non-finite logit); None when this path does not apply (no numba, not an LRU
    cache with integer byte costs, a policy without compiled keys, logits not float32 on the CPU).

    With ``weight_rule`` (:func:`weight_rule_array`) the result is ``(ids, done, weights float32 [P, K])``: the
    family's combine weights of the selected ids, computed in the same loop. ``restrict``: ``zr_PE`` are the
    family's unrestricted ranking values (``Family.ranking_parts``) and the loop restricts them to
    ``allowed_PE`` itself, exactly as ``Family.ranking`` would. ``stock`` = the model's own ``(ids, weights)``
    [P, K] (int64, float32): a token whose selection has the same experts gets the stock weights."""
    if not AVAILABLE or type(cache) is not LRUCache or not cache._compiled():
        return None
    if zr_PE.dtype != torch.float32 or z_PE.dtype != torch.float32 or zr_PE.device.type != "cpu":
        return None
    params = router.kernel_params(layer, allowed=allowed_PE is not None, restrict=restrict and allowed_PE is not None)
    if params is None:
        return None
    params.load()
    a = cache._own_arrays()
    k = router.k
    out_PK = np.empty((zr_PE.shape[0], k), np.int64)
    w_PK = _NO_W if weight_rule is None else np.empty((zr_PE.shape[0], k), np.float32)
    done = _keyed_serve(zr_PE.numpy(), z_PE.numpy(), params.ip, params.fp, params.penalty,
                        _NO_ALLOWED if allowed_PE is None else allowed_PE.numpy(), k, out_PK, a.lru_E, a.lru_S,
                        _NO_RULE if weight_rule is None else weight_rule, w_PK, *_stock_arrays(stock))
    params.store()
    if weight_rule is None:
        return out_PK, int(done)
    return out_PK, int(done), w_PK

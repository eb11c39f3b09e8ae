"""Which experts each MoE layer computes with: the routing half of the offloaded runtime.

:class:`Routes` turns the stock router's output of one MoE layer (logits ``z_TE``, weights ``w0_TK``, ids
``ids0_TK``) into the (weights, ids) the layer computes with: the routing policy's against the layer's *live*
residency (:meth:`Routes.route_policy`), or a row router's (:meth:`Routes.set_row_router`, the serve engine's
per-request override). On a device it also owns the host's copies: ONE device -> host transfer per MoE layer
brings what the host needs (:meth:`Routes.fetch_host`), and the cache step reads the ids from there
(:meth:`Routes.host_copy`). The next-layer guess (:func:`~expertcache.offload.prefetch.guess_next_layer`) routes
through it with ``commit=False``.

It reads the caches' residency and the miss costs through two functions it is given (``cache_of``,
``miss_costs``); it knows nothing of slots or reads, and it installs nothing on the model (the runtime's router
hook calls it).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from expertcache.cache import ExpertCache
from expertcache.device import to_device, to_host, to_host_many
from expertcache.models.adapters import Family, MoELayer, order_by_logits, order_row
from expertcache.routing import Router, RoutingConfig
from expertcache.routing.registry import spec

__all__ = ["Routes"]

#: logit dtypes whose values float32 holds exactly (the one-token path's ranking input and serving-order keys)
_EXACT_IN_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16)


class Routes:
    """The routing of every MoE layer (see the module docstring). ``stock_routers[i]``: MoE layer ``i``'s own
    router forward (before the runtime's hook); ``on_device``: host copies are transfers (CUDA, or the tests'
    device proxy); ``prefetch_ahead``: the next layer's stock route is fetched with this one's (guesses on)."""

    #: one token on the host goes through :meth:`_route_token` (the same decisions with a few tensor ops);
    #: False sends every call through the general path (the tests compare the two)
    token_path = True

    def __init__(self, family: Family, layers: list[MoELayer], stock_routers: list[Callable], *, on_device: bool,
                 prefetch_ahead: int, cache_of: Callable[[int], ExpertCache],
                 miss_costs: Callable[[int], np.ndarray]) -> None:
        self.family, self.layers, self.stock_routers = family, layers, stock_routers
        self.num_experts, self.top_k = layers[0].num_experts, layers[0].top_k
        self.renormalize = bool(family.renormalize(layers[0].router))
        self.on_device, self.prefetch_ahead = on_device, prefetch_ahead
        self.cache_of, self.miss_costs = cache_of, miss_costs
        self._host_copies: dict[int, tuple] = {}  # id(device tensor) -> (it, its host copy): keep_host
        self._next_route: tuple | None = None  # (MoE layer index, its stock route) made ahead for its guess
        self._row_router: Callable | None = None  # set_row_router
        self.routing = RoutingConfig()
        self.router: Router | None = None

    def configure(self, routing: RoutingConfig, freq_LE: torch.Tensor | None) -> None:
        """A new routing policy (a fresh :class:`Router`: no running state); ``freq_LE`` the ERAS profile."""
        self.routing = routing
        self.router = Router(routing, num_experts=self.num_experts, k=self.top_k, renormalize=self.renormalize,
                             scoring=self.family.scoring, freq_LE=freq_LE)

    def route(self, m: MoELayer, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor, *,
              commit: bool = True):
        """(weights [T, K], ids [T, K]) that MoE layer ``m`` computes with for the stock router's output
        (logits ``z_TE``, weights ``w0_TK``, ids ``ids0_TK``): the row router's (:meth:`set_row_router`) if one
        is set, else the routing policy's (:meth:`route_policy`). ``commit=False``: see :meth:`route_policy`."""
        rows = self._row_router
        if rows is not None:
            return rows(m, z_TE, w0_TK, ids0_TK, commit=commit)
        return self.route_policy(m, z_TE, w0_TK, ids0_TK, commit=commit)

    def set_row_router(self, fn: Callable | None) -> None:
        """Route through ``fn(m, z_TE, w0_TK, ids0_TK, *, commit)`` instead of the routing policy (None: the
        policy again). The seam of a caller that routes some rows differently (the serve engine's per-request
        ``"policy": "original"``). Contract: ``fn`` returns (weights [T, K], ids [T, K]) on the devices and
        dtypes of ``w0_TK``/``ids0_TK``; it may call :meth:`route_policy` (at most once per call, passing
        ``commit`` on) and use the stock ``w0_TK``/``ids0_TK``; with ``commit=False`` (the next-layer guess) it
        must change nothing. It is called on the compute thread for every forward and guess at every layer."""
        if fn is not None and not callable(fn):
            raise TypeError(f"a row router must be callable, got {fn!r}")
        self._row_router = fn

    def stock_route(self, index: int, x_TD: torch.Tensor):
        """(logits [T, E], weights [T, K], ids [T, K]) of MoE layer ``index``'s own router for ``x_TD``, without
        the routing policy and without a cache step (the next-layer guess's first half). On a device, the
        next layer's guess was computed by the previous layer's router call and its host copy fetched with
        that layer's (:meth:`fetch_host`): taken from there."""
        made, self._next_route = self._next_route, None
        if made is not None and made[0] == index:
            return made[1]
        return self.stock_routers[index](x_TD)

    def route_policy(self, m: MoELayer, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor, *,
                     commit: bool = True):
        """(weights [T, K], ids [T, K]) of the routing policy for logits ``z_TE`` against the live residency.
        ``commit=False``: an observer's call (the next-layer guess), which leaves the router's running state
        (Cache-Prior's Δavg, a budget controller) as it was (:meth:`Router.rank`) and reads the ids only: the
        weights returned are then the stock ones, and the next step's ids are not touched. One token on the host
        takes :meth:`_route_token` (the same decisions, fewer tensor ops)."""
        if self.routing.policy == "original":
            return w0_TK, ids0_TK
        if (not self.on_device and self.token_path and z_TE.is_cpu and z_TE.dim() == 2 and z_TE.shape[0] == 1
                and z_TE.dtype in _EXACT_IN_FLOAT32 and w0_TK.is_cpu and ids0_TK.is_cpu
                and type(self.router) is Router and self.routing.cache_aware and self.router.config.cache_aware):
            return self._route_token(m, z_TE, w0_TK, commit)
        z_cpu_TE = self.host_copy(z_TE).detach()  # the layer's one device -> host transfer (or its copy)
        zr_TE, allowed_TE = self.family.ranking(m.router, z_cpu_TE)
        if self.routing.cache_aware:
            resident_TE = torch.from_numpy(self.cache_of(m.index).resident_array()).expand_as(zr_TE)
        else:
            resident_TE = torch.ones_like(zr_TE, dtype=torch.bool)
        if allowed_TE is not None:
            resident_TE = resident_TE & allowed_TE
        if spec(self.routing.policy).miss_costs:
            self.router.set_miss_costs(m.index, self.miss_costs(m.index))
        ids_TK = order_by_logits(self.router.rank(m.index, zr_TE, resident_TE, commit=commit), z_cpu_TE)
        ids_dev_TK = self.keep_host(to_device(ids_TK, ids0_TK.device), ids_TK)  # the step reads the host copy
        if not commit:
            return w0_TK, ids_dev_TK
        w_TK = self.family.weights(m.router, z_cpu_TE, ids_TK).to(w0_TK.dtype)
        return self.keep_host(to_device(w_TK, w0_TK.device), w_TK), ids_dev_TK

    def _route_token(self, m: MoELayer, z_1E: torch.Tensor, w0_1K: torch.Tensor, commit: bool):
        """:meth:`route_policy` of ONE token on the host for a cache-aware policy (a decode step): the same ids,
        weights and running state, with the ranking on host arrays (:meth:`Router.rank_array`, the kernel call
        :meth:`Router.rank` makes) and the serving order on Python lists (:func:`order_row`, what
        :func:`order_by_logits` does for one token), so that only the family's weight formula runs as tensor
        ops (~11 a layer instead of 31: at one token a step their dispatch, not arithmetic, is the cost). Taken
        by :meth:`route_policy` for one CPU token (``is_cpu``: host memory, as ``on_host``) of float32 / bf16 /
        f16 logits (exact in float32, as its ranking and order keys need) under a plain :class:`Router` of a
        cache-aware policy (a wrapper such as ``routing.budget.BudgetRouter`` decides through its own ``rank``)."""
        if z_1E.requires_grad:
            z_1E = z_1E.detach()
        zr_1E, allowed_1E = self.family.ranking(m.router, z_1E)
        z32_1E = z_1E if z_1E.dtype == torch.float32 else z_1E.float()  # exact: bf16 / f16 / f32 logits only
        zr32_1E = z32_1E if zr_1E is z_1E else zr_1E.detach().to(torch.float32)
        resident = self.cache_of(m.index).resident_array()  # bool [E], a fresh array
        if allowed_1E is not None:
            resident = resident & allowed_1E.numpy()  # [1, E]
        if spec(self.routing.policy).miss_costs:
            self.router.set_miss_costs(m.index, self.miss_costs(m.index))
        ids_1K = self.router.rank_array(m.index, zr32_1E.numpy(), resident, self.router.probs(zr32_1E), commit=commit)
        if zr32_1E is not z32_1E:  # ranked by other values (bias, groups): the serving order is by the logits
            ids_1K[0] = order_row(ids_1K[0].tolist(), z32_1E.numpy()[0].tolist())
        # (ranked by the logits themselves, the kernel's ids are in that order already: stably by descending logit)
        ids_1K = torch.from_numpy(ids_1K)  # a fresh array (Router.rank_array)
        if not commit:
            return w0_1K, ids_1K
        return self.family.weights(m.router, z_1E, ids_1K).to(w0_1K.dtype), ids_1K

    # -- the host's copies (one device -> host transfer per MoE layer) ---------------------------

    def keep_host(self, dev: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Remember ``host`` as the host copy of device tensor ``dev`` (until the next router call); ``dev``."""
        if dev is not host:
            self._host_copies[id(dev)] = (dev, host)
        return dev

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in host memory: its kept copy (:meth:`fetch_host`, :meth:`route_policy`) when there is one,
        else a transfer of its own (a wait); ``t`` itself on the CPU."""
        kept = self._host_copies.get(id(t))
        if kept is not None and kept[0] is t:
            return kept[1]
        return to_host(t)

    def fetch_host(self, m: MoELayer, x_TD: torch.Tensor, t: int | None, z_TE: torch.Tensor, w0_TK: torch.Tensor,
                   ids0_TK: torch.Tensor) -> None:
        """Device runs: bring what the host needs from this MoE layer's router in ONE transfer -- the ids
        (``original``) or the logits (a routing policy; both, and the weights, for a row router or T > 1) and,
        with prefetch on, the same of the next MoE layer's stock router applied to ``x_TD`` (its guess,
        :meth:`stock_route`), packed (:func:`~expertcache.device.to_host_many`)."""
        self._host_copies.clear()
        self._next_route = None
        rows = self._row_router is not None
        many = z_TE.shape[0] > 1
        original = self.routing.policy == "original"

        def wanted(z, w0, ids0):
            return ([z] if rows or not original else []) + ([ids0] if rows or original else []) + \
                ([w0] if many and (rows or original) else [])
        need = wanted(z_TE, w0_TK, ids0_TK)
        if self.prefetch_ahead and m.index + 1 < len(self.layers):
            nxt = self.stock_routers[m.index + 1](x_TD)
            if t is not None:
                nxt = tuple(a[:t] for a in nxt)
            self._next_route = (m.index + 1, nxt)
            need += wanted(*nxt)
        for a, h in zip(need, to_host_many(*need)):
            self.keep_host(a, h)

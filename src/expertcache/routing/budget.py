"""Routing to a miss-rate budget: a :class:`~expertcache.routing.Router` whose strength is set per layer and per
token by a :class:`~expertcache.routing.controller.MissRateController`.

:class:`BudgetRouter` has the interface of ``Router`` that the patched model and the simulator call
(``rank``/``route``/``kernel_params``/``delta_for``, ``k``, ``num_experts``, ...). It keeps one
prepared ``Router`` per quantised strength level (sharing the per-layer Cache-Prior running Δavg and the ERAS
profile), routes each (token, layer) with the level the controller holds for that layer, counts the token's
misses against the residency it was given (a selected expert that is not resident is a miss: exactly what the
cache will count) and feeds them back. ``kernel_params`` returns None, so a patched model takes
its token-by-token path (every token routed against the live cache, then served) and the controller sees
every token in order, also inside a prefill or a teacher-forced chunk.

Install into a patched model with :func:`attach` (the one hook: it sets ``patch.router``)::

    patch = patch_model(model, RoutingConfig("cache-prior", lam=0.2), capacity=0.5)
    ctl = attach(patch, target=0.10)          # or ControllerConfig(...)
    ...run the model...
    ctl.state()                               # per-layer λ, achieved miss rate, saturation
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from expertcache.routing import kernels as _rk
from expertcache.routing.config import STRENGTH, Router
from expertcache.routing.controller import ControllerConfig, MissRateController
from expertcache.routing.policies import check_logits
from expertcache.routing.registry import STEERABLE

__all__ = ["BudgetRouter", "attach", "wrap", "expert_bytes"]


class BudgetRouter:
    """A Router for ``base.config.policy`` (cache-prior or eras-bias) with per-layer strengths from
    ``controller`` (see the module docstring). ``base``: the Router the policy would otherwise use."""

    def __init__(self, base: Router, controller: MissRateController) -> None:
        policy = base.config.policy
        if policy not in STEERABLE:
            raise ValueError(f"a miss-rate target controls {' or '.join(STEERABLE)}, not {policy!r}")
        self.base = base
        self.controller = controller
        self.config = base.config
        self._name = STRENGTH[policy]
        self._routers: dict[int, Router] = {}

    def __getattr__(self, name: str) -> Any:  # k, num_experts, renormalize, scoring, freq_LE, deltas, delta_for
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def router_at(self, level: int) -> Router:
        r = self._routers.get(level)
        if r is None:
            b = self.base
            cfg = replace(b.config, **{self._name: float(self.controller.level_value(level))})
            r = self._routers[level] = Router(cfg, num_experts=b.num_experts, k=b.k, renormalize=b.renormalize,
                                              scoring=b.scoring, freq_LE=b.freq_LE, deltas=b.deltas)
        return r

    def kernel_params(self, *args, **kwargs):
        return None

    def rank(self, layer, z_TE: torch.Tensor, resident: torch.Tensor | None, *, commit: bool = True) -> torch.Tensor:
        """``Router.rank`` at the controller's strength of each row's layer; then every row's misses (selected,
        not resident) update its layer's strength. Rows of one call share the residency they were given.
        ``commit=False`` (an observer's guess): every row at its layer's present strength, and neither the
        controller nor the running Δavg changes."""
        if not commit:
            rows = isinstance(layer, (list, tuple))
            layers = list(layer) if rows else [layer] * z_TE.shape[0]
            out = torch.empty(z_TE.shape[0], self.base.k, dtype=torch.int64, device=z_TE.device)
            for li in dict.fromkeys(layers):
                ts = [t for t, l in enumerate(layers) if l == li]
                res = resident if resident is None or resident.dim() == 1 or resident.shape[0] == 1 else resident[ts]
                out[ts] = self.router_at(self.controller.level(li)).rank(li, z_TE[ts], res, commit=False)
            return out
        rows = isinstance(layer, (list, tuple))
        layers = list(layer) if rows else [layer] * z_TE.shape[0]
        e = self.base.num_experts
        if resident is None:
            resident = torch.zeros(e, dtype=torch.bool)
        res_TE = resident.reshape(-1, e).expand(z_TE.shape[0], e) if resident.dim() == 1 or resident.shape[0] == 1 \
            else resident
        check_logits(z_TE, self.base.k, res_TE)  # once for all rows (as Router.rank would per row)
        # rows go straight to the policy kernel (what Router.rank does for one row, without its per-call torch
        # conversions): numpy in, numpy out, misses counted on the same arrays
        z_TE_np = np.ascontiguousarray(z_TE.detach().to("cpu", torch.float32).numpy())
        res_TE_np = np.ascontiguousarray(res_TE.detach().to("cpu").numpy())
        probs_TE = self.base.probs(torch.from_numpy(z_TE_np))
        out = np.empty((z_TE.shape[0], self.base.k), np.int64)
        for t, li in enumerate(layers):
            params = self.router_at(self.controller.level(li)).kernel_params(li)
            params.load()
            _, _, _, _, ids = _rk.rank(z_TE_np[t:t + 1], params.ip, params.fp, self.base.k,
                                       resident_PE=res_TE_np[t:t + 1],
                                       prob_PE=None if probs_TE is None else probs_TE[t:t + 1],
                                       penalty_PE=params.penalty)
            params.store()
            out[t] = ids[0]
            sel = ids[0][ids[0] >= 0]
            self.controller.update(li, int((~res_TE_np[t][sel]).sum()))
        return torch.from_numpy(out).to(z_TE.device)

    def route(self, layer, z_TE: torch.Tensor, resident: torch.Tensor | None, *, commit: bool = True):
        from expertcache.routing.policies import weights_for

        ids_TK = self.rank(layer, z_TE, resident, commit=commit)
        return weights_for(ids_TK, z_TE, renormalize=self.base.renormalize, scoring=self.base.scoring, dropped=False)


def attach(patch, target: float | ControllerConfig, *, record: bool = False, **kw) -> MissRateController:
    """Put a per-layer miss-rate controller into a patched model (``patch`` from
    :func:`expertcache.models.patch_model` with a cache-aware ``cache-prior`` or ``eras-bias`` policy and a
    cache); returns the controller. ``target``: a miss rate, or a full :class:`ControllerConfig`; ``kw``:
    ControllerConfig fields (gains, range, s0). ``record``: keep every layer's strength after each token."""
    if getattr(patch, "capacity", None) is None:
        raise ValueError("a miss-rate target needs a cache (patch_model(..., capacity=...))")
    patch.router = wrap(patch.router, target, len(patch.layers), record=record, **kw)
    return patch.router.controller


def wrap(router: Router, target: float | ControllerConfig, num_layers: int, *, record: bool = False,
         **kw) -> BudgetRouter:
    """A :class:`BudgetRouter` around ``router`` with a fresh controller (``.controller``): the
    ``router_hook`` of :func:`expertcache.sim.simulate` for budget-targeted routing in open loop."""
    cfg = target if isinstance(target, ControllerConfig) else \
        ControllerConfig.for_policy(router.config.policy, float(target), **kw)
    return BudgetRouter(router, MissRateController(cfg, num_layers=num_layers, k=router.k, record=record))


def expert_bytes(patch) -> int:
    """Bytes of one routed expert of a patched model as loaded (parameters of the first MoE layer's ``experts``
    module / N): the unit of ``--target-bytes-per-token`` = miss rate · K · L · expert bytes."""
    block = patch.layers[0].block
    experts = getattr(block, "experts", None)
    if experts is None:
        raise ValueError(f"{patch.family.model_type}: no .experts module in the MoE block to size an expert")
    total = sum(p.numel() * p.element_size() for p in experts.parameters())
    return max(1, total // patch.num_experts)

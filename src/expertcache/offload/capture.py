"""The offloaded runtime's seams inside the captured decode step (:class:`~expertcache.models.captured.CapturedDecode`
traces each MoE block's own code, and its custom operators call these on the host).

:class:`CapturedSeams` is the step's ``owner``: ``expertcache::route`` (:meth:`CapturedSeams.captured_route`: the
router seam's host part -- the device run's one transfer, the routing policy, the router observers),
``expertcache::cache_step`` (:meth:`~CapturedSeams.captured_cache_step`: the cache step of a token whose experts
the graph computes, :func:`~expertcache.offload.layout.inline_product` over :meth:`~CapturedSeams.graph_products`)
or ``expertcache::experts`` (:meth:`~CapturedSeams.captured_experts`: the eager cache step), and ``capturing``,
True while a captured step runs (the runtime's hooks then take their traced branch). It holds the parts it calls
(the routing, the cache steps, the observers); it installs nothing.
"""

from __future__ import annotations

from typing import Callable

import torch

from expertcache.models.adapters import MoELayer
from expertcache.offload.observe import Observers
from expertcache.offload.routes import Routes
from expertcache.offload.step import CacheSteps

__all__ = ["CapturedSeams"]


class CapturedSeams:
    """The captured decode step's owner (see the module docstring). ``acts[i]``: MoE layer ``i``'s activation
    (the ``linear`` layout's); ``inline_views``: the arena's per-matrix views when the graph computes the experts
    (set by the runtime for each arena), else None."""

    def __init__(self, layers: list[MoELayer], routes: Routes, steps: CacheSteps, observers: Observers,
                 acts: list[Callable | None]) -> None:
        self.layers, self.routes, self.steps, self.observers, self.acts = layers, routes, steps, observers, acts
        self.inline_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self.capturing = False  # True while a captured decode step runs (models/captured.py sets it)

    def captured_key(self) -> tuple:
        """What the MoE blocks' traced code bakes in: whether the experts are computed in the graph."""
        return ("inline" if self.inline_views is not None else "experts",)

    def graph_products(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable] | None:
        """(the arena's per-matrix views, MoE layer ``index``'s activation) with which the captured step's graph
        computes that layer's experts (:func:`~expertcache.offload.layout.inline_product`), or None where it does
        not (``describe()["captured_experts"]``)."""
        if self.inline_views is None:
            return None
        return self.inline_views, self.acts[index]

    def captured_route(self, x_TD: torch.Tensor, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor,
                       index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``expertcache::route``: the router seam's host part (the runtime's router hook after the stock router):
        the device run's one transfer, the routing policy, the router observers; new tensors (an operator's
        outputs never alias its inputs), whose host copies are kept for the cache step."""
        m, routes = self.layers[index], self.routes
        if routes.on_device:
            routes.fetch_host(m, x_TD, None, z_TE, w0_TK, ids0_TK)
        w_TK, ids_TK = routes.route(m, z_TE, w0_TK, ids0_TK)
        if self.observers.router:
            self.observers.notify_router(m.index, z_TE, ids_TK, w_TK)
        w_out, ids_out = w_TK.clone(), ids_TK.clone()
        if routes.on_device:
            routes.keep_host(ids_out, routes.host_copy(ids_TK))
        return w_out, ids_out

    def captured_cache_step(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, index: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``expertcache::cache_step``: :meth:`~expertcache.offload.step.CacheSteps.serve_slots`."""
        return self.steps.serve_slots(index, x_TD, ids_TK, w_TK)

    def captured_experts(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, index: int
                         ) -> torch.Tensor:
        """``expertcache::experts``: the eager cache step (:meth:`~expertcache.offload.step.CacheSteps.serve`)."""
        return self.steps.serve(index, x_TD, ids_TK, w_TK)

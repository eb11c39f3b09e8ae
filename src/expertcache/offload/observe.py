"""Observing the offloaded runtime: named hooks instead of replacing its methods.

:class:`~expertcache.offload.runtime.OffloadedModel` calls three kinds of observers (added with
:meth:`RuntimeObservers.add_step_observer`, :meth:`~RuntimeObservers.add_prefetch_observer`,
:meth:`~RuntimeObservers.add_router_observer`), each with one frozen event:

- :class:`StepEvent` after every cache step of one MoE layer: a forward's demand step (``kind="demand"``) or
  the loads of :meth:`OffloadedModel.prefetch` (``kind="prefetch"``, not counted as hits or misses);
- :class:`PrefetchEvent` after each :meth:`OffloadedModel.prefetch` call (``kind="explicit"``) and after each
  next-layer guess that issued reads into spare slots (``kind="guess"``);
- :class:`RouterEvent` after the routing of each forward at each MoE layer (the logits, the ids and weights
  the layer will use); next-layer guesses are not routings and are not reported here.

Contract: an observer runs on the compute thread, in the middle of the forward; it must not change the
runtime's state (caches, slots, router, configuration) nor call the runtime's entry points
(``forward``, ``prefetch``, ``configure``...), and it gets copies: tuples of ints and cloned tensors, which it may
keep. What an observer does cannot change a decision: with or without observers, the same tokens give
the same logits and statistics (``tests/test_observers.py``). Events are delivered once the runtime's state
is final for what they report (a step's event after the step, outside its failure handling; a guess's after
the step that made it, the first layer's at once): an observer that raises propagates the error to the caller
of the forward, and the runtime's caches, slots and statistics stay as the observed work left them.

``when`` (optional, a no-argument callable) is asked first, and the event is built only when it returns
true (e.g. the live view observes only while a page subscribes). Without observers the runtime pays one
truth test of an empty tuple per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["StepEvent", "PrefetchEvent", "RouterEvent", "RuntimeObservers", "ObserverHandle"]


@dataclass(frozen=True)
class StepEvent:
    """One cache step of MoE layer ``layer``. ``order``: the ids requested, in the order the cache served them
    (descending weight); ``hits``: per entry of ``order``, whether it was resident before the step;
    ``evicted``/``admitted``: the ids that left / entered the cache (sorted); ``resident``: the cache's
    residency after the step (sorted). ``kind``: ``"demand"`` or ``"prefetch"``. ``low``: the requested ids
    computed from their resident low-precision copies instead (``--resident-quant``; not in ``order``, not seen
    by the cache; sorted)."""

    layer: int
    kind: str
    order: tuple[int, ...]
    hits: tuple[bool, ...]
    evicted: tuple[int, ...]
    admitted: tuple[int, ...]
    resident: tuple[int, ...]
    low: tuple[int, ...] = ()

    @property
    def misses(self) -> tuple[int, ...]:
        return tuple(e for e, h in zip(self.order, self.hits) if not h)


@dataclass(frozen=True)
class PrefetchEvent:
    """Reads ahead of use at MoE layer ``layer``. ``kind="explicit"``: one :meth:`OffloadedModel.prefetch`
    call, ``requested`` the ids it was given, ``loaded`` those it loaded into the cache (the sum over these
    events is ``stats()["prefetched"]``). ``kind="guess"``: the next-layer guess made for ``layer``,
    ``requested`` the guessed ids, ``loaded`` those whose reads were issued into spare slots (the sum is
    ``stats()["prefetch"]["issued"]``)."""

    layer: int
    kind: str
    requested: tuple[int, ...]
    loaded: tuple[int, ...]


@dataclass(frozen=True)
class RouterEvent:
    """The routing of one forward at MoE layer ``layer``: the stock router's ``logits`` [T, E], and the
    ``ids`` [T, K] and ``weights`` [T, K] the layer computes with (after the routing policy and any row
    router). Tensors are clones (the observer may keep them)."""

    layer: int
    logits: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


class ObserverHandle:
    """Returned by ``add_*_observer``; :meth:`remove` detaches the observer (idempotent)."""

    def __init__(self, owner: "RuntimeObservers", attr: str, entry: tuple) -> None:
        self._owner, self._attr, self._entry = owner, attr, entry

    def remove(self) -> None:
        cur = getattr(self._owner, self._attr)
        setattr(self._owner, self._attr, tuple(x for x in cur if x is not self._entry))


class RuntimeObservers:
    """The observer registry of the offloaded runtime (a mixin of :class:`OffloadedModel`); see the module
    docstring for the contract. Each list is a tuple replaced on change (copy-on-write): adding or removing
    from another thread never disturbs a step that is iterating it."""

    _step_observers: tuple = ()
    _prefetch_observers: tuple = ()
    _router_observers: tuple = ()

    def _add(self, attr: str, fn: Callable, when: Callable[[], bool] | None) -> ObserverHandle:
        if not callable(fn) or (when is not None and not callable(when)):
            raise TypeError(f"an observer and its 'when' must be callable, got {fn!r}, {when!r}")
        entry = (fn, when)
        setattr(self, attr, getattr(self, attr) + (entry,))
        return ObserverHandle(self, attr, entry)

    def add_step_observer(self, fn: Callable[[StepEvent], None], *, when: Callable[[], bool] | None = None
                          ) -> ObserverHandle:
        """Call ``fn(StepEvent)`` after every cache step (every MoE layer of every forward; prefetch loads)."""
        return self._add("_step_observers", fn, when)

    def add_prefetch_observer(self, fn: Callable[[PrefetchEvent], None], *, when: Callable[[], bool] | None = None
                              ) -> ObserverHandle:
        """Call ``fn(PrefetchEvent)`` after each explicit prefetch and each next-layer guess's reads."""
        return self._add("_prefetch_observers", fn, when)

    def add_router_observer(self, fn: Callable[[RouterEvent], None], *, when: Callable[[], bool] | None = None
                            ) -> ObserverHandle:
        """Call ``fn(RouterEvent)`` after each forward's routing at each MoE layer."""
        return self._add("_router_observers", fn, when)

    @staticmethod
    def _live(observers: tuple) -> list:
        return [fn for fn, when in observers if when is None or when()]

    def _notify_step(self, index: int, kind: str, order, hits, before, after, low=()) -> None:
        fns = self._live(self._step_observers)
        if not fns:
            return
        before, after = set(before), set(after)
        ev = StepEvent(index, kind, tuple(int(e) for e in order), tuple(bool(h) for h in hits),
                       tuple(sorted(before - after)), tuple(sorted(after - before)), tuple(sorted(after)),
                       tuple(sorted(int(e) for e in low)))
        for fn in fns:
            fn(ev)

    def _notify_prefetch(self, index: int, kind: str, requested, loaded) -> None:
        fns = self._live(self._prefetch_observers)
        if not fns:
            return
        ev = PrefetchEvent(index, kind, tuple(int(e) for e in requested), tuple(int(e) for e in loaded))
        for fn in fns:
            fn(ev)

    def _notify_router(self, index: int, z_TE: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> None:
        fns = self._live(self._router_observers)
        if not fns:
            return
        ev = RouterEvent(index, z_TE.detach().clone(), ids_TK.detach().clone(), w_TK.detach().clone())
        for fn in fns:
            fn(ev)

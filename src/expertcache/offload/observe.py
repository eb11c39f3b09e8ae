"""Observing the offloaded runtime: named hooks instead of replacing its methods.

:class:`~expertcache.offload.runtime.OffloadedModel` owns one :class:`Observers` registry and hands it to the
parts that report (the cache steps, the router hook); it calls three kinds of observers (added with
``OffloadedModel.add_step_observer``, ``add_prefetch_observer``, ``add_router_observer``, or
:meth:`Observers.add`), each with one frozen event:

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

__all__ = ["StepEvent", "PrefetchEvent", "RouterEvent", "Observers", "ObserverHandle"]


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

    def __init__(self, owner: "Observers", kind: str, entry: tuple) -> None:
        self._owner, self._kind, self._entry = owner, kind, entry

    def remove(self) -> None:
        self._owner.discard(self._kind, self._entry)


class Observers:
    """The observer registry of the offloaded runtime (one object the runtime owns and hands to its parts);
    see the module docstring for the contract. ``step``, ``prefetch`` and ``router`` are tuples of
    ``(fn, when)`` replaced on change (copy-on-write): adding or removing from another thread never disturbs a
    step that is iterating one; an empty tuple is the hot path's one truth test."""

    KINDS = ("step", "prefetch", "router")

    def __init__(self) -> None:
        self.step: tuple = ()
        self.prefetch: tuple = ()
        self.router: tuple = ()

    def add(self, kind: str, fn: Callable, when: Callable[[], bool] | None = None) -> ObserverHandle:
        """Add observer ``fn`` of ``kind`` (one of :attr:`KINDS`), called only while ``when()`` is true."""
        if kind not in self.KINDS:
            raise ValueError(f"observer kind must be one of {', '.join(self.KINDS)}, got {kind!r}")
        if not callable(fn) or (when is not None and not callable(when)):
            raise TypeError(f"an observer and its 'when' must be callable, got {fn!r}, {when!r}")
        entry = (fn, when)
        setattr(self, kind, getattr(self, kind) + (entry,))
        return ObserverHandle(self, kind, entry)

    def discard(self, kind: str, entry: tuple) -> None:
        """Remove ``entry`` (an ``(fn, when)`` that :meth:`add` made) from ``kind``, if it is there."""
        setattr(self, kind, tuple(x for x in getattr(self, kind) if x is not entry))

    @staticmethod
    def _live(observers: tuple) -> list:
        return [fn for fn, when in observers if when is None or when()]

    def notify_step(self, index: int, kind: str, order, hits, before, after, low=()) -> None:
        """A :class:`StepEvent` to every live step observer."""
        fns = self._live(self.step)
        if not fns:
            return
        before, after = set(before), set(after)
        ev = StepEvent(index, kind, tuple(int(e) for e in order), tuple(bool(h) for h in hits),
                       tuple(sorted(before - after)), tuple(sorted(after - before)), tuple(sorted(after)),
                       tuple(sorted(int(e) for e in low)))
        for fn in fns:
            fn(ev)

    def notify_prefetch(self, index: int, kind: str, requested, loaded) -> None:
        """A :class:`PrefetchEvent` to every live prefetch observer."""
        fns = self._live(self.prefetch)
        if not fns:
            return
        ev = PrefetchEvent(index, kind, tuple(int(e) for e in requested), tuple(int(e) for e in loaded))
        for fn in fns:
            fn(ev)

    def notify_router(self, index: int, z_TE: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> None:
        """A :class:`RouterEvent` (cloned tensors) to every live router observer."""
        fns = self._live(self.router)
        if not fns:
            return
        ev = RouterEvent(index, z_TE.detach().clone(), ids_TK.detach().clone(), w_TK.detach().clone())
        for fn in fns:
            fn(ev)

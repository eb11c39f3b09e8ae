"""Fast-tier memory of the experts: page-aligned expert slots and which expert each one holds.

A :class:`SlotArena` owns every slot of the model, ``L·C + S + P`` of ``slot_bytes`` each, in one anonymous
mapping (page-aligned, so ``O_DIRECT`` reads land in place): C **cache** slots per MoE layer (the
residents of that layer's expert cache, held by its :class:`SlotPool`), and S **scratch** and P **spare**
slots **shared by all layers**. Layers run one after another, so one layer's scratch (a requested expert
the cache does not keep, only when a step requests more than C) is free again before the next layer runs,
and the P spares (next-layer prefetch buffers) only ever hold guesses for the next layer or two: L per-layer
copies of either would spend ``L·(S + P)`` slots of the budget where ``S + P`` do.

Slot numbers are physical; roles move: when a prefetched expert becomes resident its spare slot becomes a
cache slot of that layer and the cache slot it gave up becomes a spare (no copy). Reads in flight are tracked
per slot (:attr:`SlotArena.pending`), so nothing computes from, or reads into, a slot whose read is still in
flight; which expert of which layer a slot's cached views describe is :attr:`SlotArena.placement`.

The arena holds no policy: the runtime tells it which expert goes where.
"""

from __future__ import annotations

import mmap

import torch

from expertcache.offload.ioqueue import Ticket
from expertcache.offload.layout import slot_bytes_for  # re-exported: the slot size is the layout's

__all__ = ["SlotArena", "SlotPool", "slot_bytes_for"]


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux ≥ 5.14; Python 3.11 lacks the name


def _anonymous(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` (page-aligned), committed now (``MADV_POPULATE_WRITE``): the plan's
    memory is taken (or refused, in a memory cgroup) before the first token, and no miss pays the first touch of
    its slot's pages on the critical path; silently left to fault in where the kernel lacks the advice.

    Private, not ``mmap.mmap(-1, n)``'s default ``MAP_SHARED``: a shared anonymous mapping is shmem, whose pages
    cost more to commit (1.7 GiB on the 2-core AMD EPYC VM: 1.0-1.6 s shared, 0.6-0.8 s private) and whose
    transparent huge pages ``shmem_enabled`` governs (``never`` by default), so the ``MADV_HUGEPAGE`` the arena
    used to ask for never took effect. It is not asked for now: on a private mapping, committing 1.7 GiB of huge
    pages took 1.6-4.1 s there (0.2 s per GiB at best: ``defrag=madvise`` stalls the fault until a huge page is
    found), so the slots keep the 4 KiB pages they always had, and the decode streams them as it did."""
    private = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    m = mmap.mmap(-1, nbytes, **({} if None in private else {"flags": private[0] | private[1]}))  # Windows: no flags
    try:
        m.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError, AttributeError):
        pass
    return m


class SlotArena:
    """All slots of the model (see the module docstring). ``buffer`` is [L·C + S + P, slot_bytes] uint8;
    ``pools[i]`` is MoE layer i's :class:`SlotPool`."""

    def __init__(self, layers: int, capacity: int, slot_bytes: int, device: torch.device, *, scratch: int = 1,
                 spare: int = 0) -> None:
        self.layers, self.capacity, self.slot_bytes = layers, capacity, slot_bytes
        n = layers * capacity + scratch + spare
        if device.type == "cpu":
            self._map = _anonymous(n * slot_bytes)  # page-aligned, committed
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8).view(n, slot_bytes)
        else:  # pragma: no cover - GPU only
            self.buffer = torch.empty(n, slot_bytes, dtype=torch.uint8, device=device)
        self.nbytes = n * slot_bytes
        self._nscratch, self._nspare = scratch, spare
        self.pools = [SlotPool(self, i) for i in range(layers)]
        self.reset()

    def reset(self) -> None:
        """Forget every expert (pending reads must have been drained by the caller)."""
        c0 = self.layers * self.capacity
        self.scratch: list[int] = list(range(c0, c0 + self._nscratch))
        self.spares: list[int] = list(range(c0 + self._nscratch, c0 + self._nscratch + self._nspare))
        self.guesses: dict[int, tuple[int, int]] = {}  # spare slot -> (layer, expert) it holds, oldest first
        self.pending: dict[int, Ticket] = {}  # slot -> read in flight (or not yet waited for)
        self.placement: dict[int, object] = {}  # slot -> ((layer, expert), Placement, views or None)
        self.busy: set[int] = set()  # spares the step under way computes from (never claimed meanwhile)
        for pool in self.pools:
            pool.reset()

    def tickets(self) -> list[Ticket]:
        return list(self.pending.values())

    def claim_spares(self, n: int) -> list[int]:
        """Up to ``n`` spare slots for new guesses, none with a read still in flight (a guess never waits
        for another one): empty spares first, then those whose guess is oldest; each is taken from the
        guess it held."""
        ready = [s for s in self.spares if s not in self.busy and (s not in self.pending or self.pending[s].ready)]
        out = [s for s in ready if s not in self.guesses][:n]
        if len(out) < n:
            ready_set = set(ready)
            out += [s for s in self.guesses if s in ready_set][:n - len(out)]
        for s in out:
            self.release(s)
        return out

    def hold(self, slot: int, layer: int, e: int) -> None:
        """Spare ``slot`` now holds (or receives) expert ``e`` of ``layer``, guessed for it."""
        self.guesses[slot] = (layer, e)
        self.pools[layer].prefetched[e] = slot

    def release(self, slot: int) -> None:
        """Spare ``slot`` no longer holds a guess (if it did)."""
        held = self.guesses.pop(slot, None)
        if held is not None:
            self.pools[held[0]].prefetched.pop(held[1], None)

    def to_cache(self, spare: int, slot: int) -> None:
        """The guessed expert in ``spare`` becomes resident there; the free cache ``slot`` becomes a spare."""
        self.release(spare)
        self.spares[self.spares.index(spare)] = slot


class SlotPool:
    """The cache slots of one MoE layer: ``slot_of`` (resident expert → slot), ``free`` (cache slots holding
    no resident) and ``prefetched`` (non-resident expert → the shared spare slot holding its guessed copy).
    The buffer, scratch, spares, reads in flight and placements are the arena's (shared)."""

    def __init__(self, arena: SlotArena, index: int) -> None:
        self.arena, self.index = arena, index
        self.buffer = arena.buffer

    def reset(self) -> None:
        c = self.arena.capacity
        self.slot_of: dict[int, int] = {}  # resident expert -> cache slot
        self.free: list[int] = list(range((self.index + 1) * c - 1, self.index * c - 1, -1))
        self.prefetched: dict[int, int] = {}

    @property
    def scratch(self) -> list[int]:
        return self.arena.scratch

    @property
    def pending(self) -> dict[int, Ticket]:
        return self.arena.pending

    @property
    def placement(self) -> dict[int, object]:
        return self.arena.placement

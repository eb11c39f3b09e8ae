"""Fast-tier memory of one MoE layer: page-aligned expert slots and which expert each one holds.

A :class:`SlotPool` owns ``C + S + P`` slots of ``slot_bytes`` each in one anonymous mapping (page-aligned,
so ``O_DIRECT`` reads land in place): C **cache** slots (the residents of the layer's expert cache), S
**scratch** slots (a requested expert the cache does not keep, only when a step requests more than C) and
P **spare** slots (next-layer prefetch buffers). Slot numbers are physical; roles move: when a prefetched
expert becomes resident its spare slot becomes a cache slot and a freed cache slot becomes a spare (no
copy). Pending reads are tracked per slot (:attr:`pending`), so nothing computes from, or reads into, a
slot whose read is still in flight.

The pool holds no policy: the runtime tells it which expert goes where.
"""

from __future__ import annotations

import mmap

import torch

from expertcache.offload.ioqueue import Ticket
from expertcache.offload.store import ALIGN

__all__ = ["SlotPool", "slot_bytes_for"]


def slot_bytes_for(nbytes: int) -> int:
    """Slot size for placements of up to ``nbytes``: rounded up to whole pages."""
    return -(-nbytes // ALIGN) * ALIGN


class SlotPool:
    """Slots of one layer (see the module docstring). ``buffer`` is [C + S + P, slot_bytes] uint8."""

    def __init__(self, capacity: int, slot_bytes: int, device: torch.device, *, scratch: int = 1,
                 spare: int = 0) -> None:
        self.capacity, self.slot_bytes = capacity, slot_bytes
        n = capacity + scratch + spare
        if device.type == "cpu":
            self._map = mmap.mmap(-1, n * slot_bytes)  # page-aligned, committed on first touch
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8).view(n, slot_bytes)
        else:  # pragma: no cover - GPU only
            self.buffer = torch.empty(n, slot_bytes, dtype=torch.uint8, device=device)
        self.nbytes = n * slot_bytes
        self._scratch0, self._nscratch, self._nspare = capacity, scratch, spare
        self.reset()

    def reset(self) -> None:
        """Forget every expert (pending reads must have been drained by the caller)."""
        c = self.capacity
        self.slot_of: dict[int, int] = {}  # resident expert -> cache slot
        self.free: list[int] = list(range(c - 1, -1, -1))  # cache slots holding no resident
        self.scratch: list[int] = list(range(c, c + self._nscratch))
        self.spares: list[int] = list(range(c + self._nscratch, c + self._nscratch + self._nspare))
        self.prefetched: dict[int, int] = {}  # non-resident expert -> spare slot holding (or receiving) it
        self.pending: dict[int, Ticket] = {}  # slot -> read in flight (or not yet waited for)
        self.placement: dict[int, object] = {}  # slot -> Placement of the expert it holds

    def tickets(self) -> list[Ticket]:
        return list(self.pending.values())

"""Loading experts into slots: the reads of the cache steps, handed to the reader threads, and the waits for them.

:class:`SlotReads` knows the tiers (:mod:`~expertcache.offload.store`, the host cache of
:mod:`~expertcache.offload.tiers`), the reader threads (:class:`~expertcache.offload.ioqueue.IOQueue`) and
where each expert's bytes go (its :class:`~expertcache.offload.layout.Placement`); it knows nothing of caches,
policies or models. The cache step (:mod:`~expertcache.offload.step`) says which expert goes into which slot
(:meth:`SlotReads.submit`) and waits for a slot before computing from it (:meth:`SlotReads.ready`).

GPU: with a CUDA device a read is one ``non_blocking`` copy from pinned memory into the slot on the copy
stream (host tier: the expert's pinned row; disk tier and host cache: the reader's pinned staging buffer after
the read into it), ordered after the compute stream's earlier work on that slot and before its next use by
per-slot CUDA events (:meth:`SlotReads.cuda_job`); the compute stream's waits are timed by event pairs and
booked as ``io_wait_seconds`` by :meth:`SlotReads.resolve_stalls`.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

from expertcache.offload.ioqueue import IOQueue, Ticket
from expertcache.offload.layout import Placement
from expertcache.offload.slots import SlotArena
from expertcache.offload.store import HostTier

__all__ = ["SlotReads"]


class SlotReads:
    """The reads of experts into slots (see the module docstring). ``parts`` / ``placement``: (MoE layer index,
    expert) -> its :class:`~expertcache.offload.checkpoint.ExpertParts` / :class:`Placement`; ``host``: the
    host-RAM cache level, or None. ``io_wait_seconds``: seconds the compute thread waited for reads."""

    def __init__(self, tier, host, readers: IOQueue, parts: dict, placement: dict, slot_bytes: int,
                 device: torch.device) -> None:
        self.tier, self.host, self.readers = tier, host, readers
        self.parts, self.placement, self.slot_bytes = parts, placement, slot_bytes
        self.device = device
        self.cuda = device.type == "cuda"
        self.staging = threading.local()  # CUDA: each reader's pinned staging buffer (disk tier, host cache)
        # CUDA: reads copy on their own stream; per slot, the event its copy waits for and the one compute waits for
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.slot_free: dict[int, object] = {}
        self.slot_ready: dict[int, object] = {}
        self.stalls: list[tuple] = []  # CUDA: (event before, event after) each compute-stream wait on a copy
        self.io_wait_seconds = 0.0

    def reset_stats(self) -> None:
        self.io_wait_seconds = 0.0
        self.stalls.clear()

    def submit(self, st, e: int, slot: int, done: "queue.SimpleQueue | None" = None) -> Ticket:
        """Queue the read of expert ``e`` of layer ``st`` (its ``moe`` and slot ``pool``) into ``slot`` (any read
        still in flight into that slot is waited for first: two reads never race for one slot)."""
        pool = st.pool
        old = pool.pending.pop(slot, None)
        if old is not None:
            self.wait(old, swallow=True)
        key = (st.moe.index, e)
        placement = self.placement[key]
        pool.placement[slot] = (key, placement, None)
        if self.cuda:  # pragma: no cover - GPU only: the copy into the slot waits for the work queued on it so far
            self.slot_free[slot] = free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))
        t0 = time.perf_counter()
        ticket = self.readers.submit(self.job(st, e, slot, placement), tag=(e, slot), done=done)
        if not self.readers.readers:  # serial: the read ran right here, on the compute thread
            self.io_wait_seconds += time.perf_counter() - t0
        pool.pending[slot] = ticket
        return ticket

    def job(self, st, e: int, slot: int, placement: Placement) -> Callable[[], int]:
        """The read of expert ``e`` of layer ``st`` into ``slot``, as a reader thread runs it (returns the bytes
        read): decided here, in issue order (compute thread), moved by a reader."""
        dest = st.pool.buffer[slot]
        tier, layer_id, parts = self.tier, st.moe.layer_id, self.parts[(st.moe.index, e)]
        if self.host is not None:  # two levels
            planned = self.host.plan(st.moe.index, e)
            read = lambda buf: self.host.job(planned, parts, placement, buf)()
        elif isinstance(tier, HostTier):
            read = lambda buf: tier.read(layer_id, e, buf)
        else:
            read = lambda buf: tier.read(parts, placement, buf)
        if not self.cuda:
            return lambda: read(dest)
        return self.cuda_job(slot, dest, read, None if self.host is not None or not isinstance(tier, HostTier)
                             else tier.rows[layer_id][e])

    def cuda_job(self, slot: int, dest: torch.Tensor, read: Callable, row: torch.Tensor | None
                 ) -> Callable[[], int]:  # pragma: no cover - GPU only (tests/test_gpu.py)
        """The read of one expert into CUDA slot ``slot``, overlapped (issue 23): on the copy stream, after the
        compute stream's work queued before the read was issued (the slot's previous occupant may still be in
        use there), one ``non_blocking`` copy from pinned memory into the slot -- the host tier's pinned row
        itself, or (disk, host cache) this reader's pinned staging buffer after the read into it; the slot's
        ready event is recorded after it, and the compute stream waits on that event before its first use of
        the slot (:meth:`ready`): no staging memcpy for the host tier, no host-side sync."""
        stream, free = self.copy_stream, self.slot_free.pop(slot, None)  # None: not issued by submit

        def job() -> int:
            t0 = time.perf_counter()
            if row is not None:
                src, n = row, row.numel()
            else:
                local = self.staging
                if getattr(local, "buf", None) is None:
                    local.buf = self.pinned_buffer(self.slot_bytes)
                    local.done = None
                if local.done is not None:  # the previous copy out of this staging buffer has finished
                    local.done.synchronize()
                n = read(local.buf)
                src = local.buf[:n]
            ready = torch.cuda.Event()
            with torch.cuda.stream(stream):
                if free is not None:
                    stream.wait_event(free)
                dest[:n].copy_(src, non_blocking=True)
                ready.record(stream)
            if row is None:
                self.staging.done = ready
            else:  # the host tier's own counters (its read() is not called: the copy is issued here)
                self.tier.stats.add(n, time.perf_counter() - t0)
            self.slot_ready[slot] = ready
            return n
        return job

    @staticmethod
    def pinned_buffer(nbytes: int) -> torch.Tensor:  # pragma: no cover - GPU only
        """A reader's staging buffer: page-locked host memory (async copies to the device; O_DIRECT reads)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def wait(self, ticket: Ticket, swallow: bool = False) -> None:
        """Wait for one read (booked in :attr:`io_wait_seconds`); its error raised unless ``swallow``."""
        t0 = time.perf_counter()
        try:
            ticket.wait()
        except BaseException:
            if not swallow:
                raise
        finally:
            self.io_wait_seconds += time.perf_counter() - t0

    def drain(self, arena: SlotArena | None) -> None:
        """Wait for every read in flight into ``arena`` (errors ignored: the slots are about to be reset)."""
        if arena is not None:
            for t in arena.tickets():
                self.wait(t, swallow=True)
            arena.pending.clear()
        if self.cuda:  # pragma: no cover - GPU only
            # copies the readers queued may still be writing into slots about to be freed or reused (an unused
            # prefetch, most likely): the copy stream is drained before any slot changes hands
            self.copy_stream.synchronize()
            self.slot_ready.clear()
            self.slot_free.clear()

    def ready(self, pool, slot: int) -> None:
        """Slot ``slot`` of ``pool`` is ready to compute from: its read waited for (the host) and, on a CUDA
        device, the compute stream ordered after its copy (a device-side wait, timed by an event pair)."""
        t = pool.pending.pop(slot, None)
        if t is not None:
            self.wait(t)
        if self.cuda:  # pragma: no cover - GPU only: compute after the slot's copy (a device-side wait)
            ready = self.slot_ready.pop(slot, None)
            if ready is not None:
                # timed on the device: the compute stream's stall on the copy is the copy wait of a GPU run
                # (the host never blocks here); resolved into io_wait_seconds by resolve_stalls()
                stream = torch.cuda.current_stream(self.device)
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record(stream)
                stream.wait_event(ready)
                after.record(stream)
                self.stalls.append((before, after))

    def resolve_stalls(self) -> None:
        """Book the device-side copy waits timed so far (CUDA events) into :attr:`io_wait_seconds`."""
        if self.stalls:  # pragma: no cover - GPU only
            self.stalls[-1][1].synchronize()
            self.io_wait_seconds += sum(a.elapsed_time(b) for a, b in self.stalls) / 1e3
            self.stalls.clear()

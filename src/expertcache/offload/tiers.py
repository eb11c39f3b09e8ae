"""The second level of a two-level expert cache: fast slots ← a host-RAM cache of expert bytes ← disk.

With ``--tier disk --host-memory SIZE`` a miss of a layer's fast slots is served from :class:`HostCache` (a
memory copy) when the expert's bytes are there, and otherwise read from the disk tier (the
:class:`~expertcache.offload.store.DiskTier`, O_DIRECT by default) and admitted into the host cache. On a GPU
the fast level is device memory and the host level pinned RAM; on a CPU both are RAM, but the cost differs
all the same (a memcpy at ~10 GB/s against a device read at ~1 GB/s plus its latency).

The host cache holds ``H = SIZE // slot_bytes`` experts (at most every expert of every MoE layer), one slot
each, in one page-aligned mapping; which (layer, expert) pairs it holds is decided by an LRU
(:func:`expertcache.cache.make_cache`, the one eviction kernel ``cache/base.py: serve_one``) over global ids
``index · N + e``. In each step the fast hits first refresh their host entries, those that have one
(:meth:`HostCache.touch`), then each miss is a host access in issue order (:meth:`HostCache.plan`); so the
host level keeps the H most recently used experts of the whole model.

Deciding and moving are apart, as everywhere in the runtime: :meth:`HostCache.plan` (compute thread, in issue
order: so the host residency, and the routing that reads it, are deterministic whatever the reader threads
do) decides where a miss comes from and reserves the host slot; :meth:`HostCache.job` returns the callable a
reader thread runs (copy out of the host slot; or read the disk into the fast slot, then copy into the host
slot). Reuse of a host slot is ordered by versions: a copy out waits until its version's bytes are in, and a
fill waits until the copies out of the previous occupant (and its fill) are done. Every wait is on a job
issued earlier, so with a FIFO of reader threads nothing deadlocks, and with 0 readers every job runs inline
in issue order.

The bytes copied are the fast slot's bytes exactly (the disk placement, aligned head included), so a host
hit leaves the slot byte-for-byte as a disk read would: logits never depend on the level a miss came from.

Costs for cost-aware routing (:meth:`HostCache.miss_costs`): the expected seconds of one load from each
level, ``expert bytes ÷ bandwidth``, with the bandwidth measured by this run once a level has
:data:`MEASURED_AFTER` loads, and the priors :data:`PRIOR_HOST_BW`, :data:`PRIOR_DISK_BW` before. The
measured seconds of a load run from its issue (:meth:`HostCache.plan`) to its bytes being in the fast slot:
the copy or the read plus the hand-off to and from the reader thread, which for small experts is most of a
host hit's cost (``host_seconds``/``disk_seconds``; the copy or read alone is in ``*_busy_seconds``).
"""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from expertcache.cache import make_cache
from expertcache.offload.budget import format_bytes, parse_bytes

__all__ = ["HostCache", "TierCounts", "parse_host_memory", "PRIOR_HOST_BW", "PRIOR_DISK_BW", "MEASURED_AFTER"]

#: bytes/second assumed for a host-RAM copy before the run has measured one (a memcpy)
PRIOR_HOST_BW = 10e9
#: bytes/second assumed for a disk read before the run has measured one (a VM / NVMe O_DIRECT read)
PRIOR_DISK_BW = 1.5e9
#: loads of a level after which its measured bandwidth replaces the prior
MEASURED_AFTER = 8


def parse_host_memory(text: str | int | None) -> int:
    """``--host-memory``: a byte size ≥ 0 (0 or None = no host cache). ValueError naming the flag otherwise."""
    if text is None:
        return 0
    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise ValueError(f"--host-memory: {exc}") from None
    if n < 0:
        raise ValueError(f"--host-memory must be a size ≥ 0 (e.g. 64MiB; 0 = no host cache), got {text!r}")
    return n


@dataclass
class TierCounts:
    """Where the fast-slot misses came from. ``host_hits`` + ``disk_reads`` = loads into fast slots (demand
    misses, and also prefetch loads: next-layer guesses, ``OffloadedModel.prefetch``; ``warm()`` zeroes them);
    ``fast_hits`` are counted by the runtime (the fast caches' hits). ``*_seconds``: issue to landed, summed
    per load (what cost-aware routing prices); ``*_busy_seconds``: the copy or the read alone."""

    host_hits: int = 0
    disk_reads: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0
    host_seconds: float = 0.0
    disk_seconds: float = 0.0
    host_busy_seconds: float = 0.0
    disk_busy_seconds: float = 0.0
    host_evictions: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["host_bandwidth"] = self.host_bytes / self.host_seconds if self.host_seconds > 0 else 0.0
        d["disk_bandwidth"] = self.disk_bytes / self.disk_seconds if self.disk_seconds > 0 else 0.0
        return d


class HostCache:
    """A host-RAM LRU of expert byte blobs over every MoE layer (see the module docstring).

    ``budget``: bytes (≥ one slot); ``slot_bytes``: bytes per entry (the fast slots' size); ``num_layers``
    L, ``num_experts`` N: entries are capped at L·N. ``disk``: the tier a host miss reads from (its
    ``read(parts, placement, dest)``)."""

    def __init__(self, budget: int, slot_bytes: int, num_layers: int, num_experts: int, disk) -> None:
        if budget < slot_bytes:
            raise ValueError(f"--host-memory {format_bytes(budget)} holds no expert: one host slot is "
                             f"{format_bytes(slot_bytes)} ({slot_bytes} bytes); give at least that, or 0 for no "
                             "host cache")
        self.budget, self.slot_bytes = budget, slot_bytes
        self.num_layers, self.num_experts = num_layers, num_experts
        self.slots = min(budget // slot_bytes, num_layers * num_experts)
        self.nbytes = self.slots * slot_bytes
        self.disk = disk
        self._map = mmap.mmap(-1, self.nbytes)  # page-aligned, committed on first touch
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8).view(self.slots, slot_bytes)
        self._cv = threading.Condition()
        self.reset()

    def reset(self) -> None:
        """Forget every entry and zero the counters (reads in flight must have been drained by the caller)."""
        self.lru = make_cache("lru", self.num_layers * self.num_experts, self.slots)
        self.slot_of: dict[int, int] = {}  # global id -> host slot
        self.free = list(range(self.slots - 1, -1, -1))
        self.resident_LE = np.zeros((self.num_layers, self.num_experts), dtype=bool)
        self._ver = [0] * self.slots  # version of each slot's current occupant
        self._filled = [0] * self.slots  # the last version whose bytes are complete (or failed)
        self._failed: set[tuple[int, int]] = set()
        self._users: dict[tuple[int, int], int] = {}  # (slot, version) -> copies out not yet done
        self.counts = TierCounts()

    # -- deciding (compute thread) -----------------------------------------------------------------

    def touch(self, index: int, experts) -> None:
        """Fast hits of layer ``index``: refresh the host entries of those that have one (recency only)."""
        gids = [index * self.num_experts + int(e) for e in experts]
        gids = [g for g in gids if g in self.slot_of]
        if gids:
            self.lru.access_step(gids)

    def plan(self, index: int, e: int) -> tuple[bool, int, int, float]:
        """Where the fast-slot miss of expert ``e`` at layer ``index`` comes from: ``(from_host, slot,
        version, issue time)``. A host miss is admitted now (its slot reserved for the disk read's bytes; the LRU
        victim, if any, leaves the host cache)."""
        g = index * self.num_experts + e
        with self._cv:
            slot = self.slot_of.get(g)
            self.lru.access_step([g])
            if slot is not None:
                v = self._ver[slot]
                self._users[(slot, v)] = self._users.get((slot, v), 0) + 1
                return True, slot, v, time.perf_counter()
            if not self.free:  # the LRU evicted exactly one entry: the one of slot_of it no longer holds
                victim = next(x for x in self.slot_of if x not in self.lru)
                self.free.append(self.slot_of.pop(victim))
                self.resident_LE[divmod(victim, self.num_experts)] = False
                self.counts.host_evictions += 1
            slot = self.free.pop()
            self.slot_of[g] = slot
            self.resident_LE[index, e] = True
            self._ver[slot] += 1
            return False, slot, self._ver[slot], time.perf_counter()

    def resident_mask(self, index: int) -> np.ndarray:
        """bool [N]: the experts of layer ``index`` whose bytes the host cache holds (or is receiving)."""
        return self.resident_LE[index]

    def miss_costs(self, nbytes: int) -> tuple[float, float]:
        """(seconds to load ``nbytes`` from host RAM, from disk): measured bandwidth of this run's loads of each
        level once there are :data:`MEASURED_AFTER` of them, the priors before."""
        c = self.counts
        host_bw = PRIOR_HOST_BW
        if c.host_hits >= MEASURED_AFTER and c.host_seconds > 0:
            host_bw = c.host_bytes / c.host_seconds
        disk_bw = PRIOR_DISK_BW
        if c.disk_reads >= MEASURED_AFTER and c.disk_seconds > 0:
            disk_bw = c.disk_bytes / c.disk_seconds
        return nbytes / host_bw, nbytes / disk_bw

    # -- moving (reader threads) -------------------------------------------------------------------

    def job(self, planned: tuple[bool, int, int, float], parts, placement, dest_u8: torch.Tensor) -> Callable[[], int]:
        """The callable a reader runs for a planned miss: copy the host slot into ``dest_u8`` (the fast
        slot), or read the disk into ``dest_u8`` and copy it into the host slot. Returns the bytes moved."""
        from_host, slot, v, issued = planned
        n = placement.nbytes

        if from_host:
            def copy_out() -> int:
                try:
                    with self._cv:
                        self._cv.wait_for(lambda: self._filled[slot] >= v)
                        if (slot, v) in self._failed:
                            raise OSError(f"the disk read that was to fill host slot {slot} failed "
                                          "(see the first error)")
                    t0 = time.perf_counter()
                    dest_u8[:n].copy_(self.buffer[slot, :n])
                    dt = time.perf_counter() - t0
                finally:
                    with self._cv:
                        left = self._users[(slot, v)] - 1
                        if left:
                            self._users[(slot, v)] = left
                        else:
                            del self._users[(slot, v)]
                        self._cv.notify_all()
                with self._cv:
                    c = self.counts
                    c.host_hits += 1
                    c.host_bytes += n
                    c.host_busy_seconds += dt
                    c.host_seconds += time.perf_counter() - issued
                return n
            return copy_out

        def fill() -> int:
            ok = False
            try:
                t0 = time.perf_counter()
                got = self.disk.read(parts, placement, dest_u8)
                dt = time.perf_counter() - t0
                with self._cv:  # the previous occupant's fill and copies out are done before we overwrite
                    self._cv.wait_for(lambda: self._filled[slot] >= v - 1 and not self._users.get((slot, v - 1)))
                self.buffer[slot, :n].copy_(dest_u8[:n])
                ok = True
            finally:
                with self._cv:
                    if not ok:
                        self._failed.add((slot, v))
                    self._filled[slot] = max(self._filled[slot], v)
                    if ok:
                        c = self.counts
                        c.disk_reads += 1
                        c.disk_bytes += got
                        c.disk_busy_seconds += dt
                        c.disk_seconds += time.perf_counter() - issued
                    self._cv.notify_all()
            return got
        return fill

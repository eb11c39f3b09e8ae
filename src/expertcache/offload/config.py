"""Configuration of the offloaded runtime (defaults live here; the CLI reads them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OffloadConfig"]


@dataclass(frozen=True)
class OffloadConfig:
    """Where experts live, how many fit, and how they are read.

    tier: 'disk' (read the checkpoint on every miss) or 'host' (all experts in host RAM). io: disk reads,
    'direct' | 'fadvise' | 'cached' (see :mod:`expertcache.offload.store`). capacity: slots per layer C, or
    None to derive it from ``memory`` (bytes or '3GiB'); both None = every expert (C = N). quant: None,
    'int8' or 'int4' (group ``group``; None = the largest divisor of D and F up to 64, see
    :func:`~expertcache.offload.quant.default_group`). context, batch: the KV cache the budget reserves. readers: reader
    threads of the I/O queue (0 = every read on the compute thread, serial). prefetch: spare slots shared by all layers
    for next-layer speculative prefetch (0 = off; they are part of the memory plan). host_memory: with
    ``tier='disk'``, the budget (bytes or '64MiB') of a host-RAM cache of expert bytes between the fast slots
    and the disk (:mod:`~expertcache.offload.tiers`; None or 0 = none, every miss reads the disk).
    """

    tier: str = "disk"
    io: str = "direct"
    capacity: int | None = None
    memory: int | str | None = None
    quant: str | None = None
    group: int | None = None
    context: int = 2048
    batch: int = 1
    readers: int = 4
    prefetch: int = 0
    host_memory: int | str | None = None

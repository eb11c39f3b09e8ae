"""The slot arena's memory (``offload/slots.py``): one private anonymous mapping, committed when the arena is
built (the memory plan's slots taken before the first token), zero-filled and writable. Private, not shmem: a
shared anonymous mapping's pages are shmem (slower to commit; huge pages never applied to them)."""

import pytest
import torch

from expertcache.offload.slots import SlotArena

MiB = 2**20


def _status(key: str) -> int:
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith(key))


def _has(key: str) -> bool:
    try:
        return any(ln.startswith(key) for ln in open("/proc/self/status"))
    except OSError:
        return False


@pytest.mark.skipif(not (_has("RssAnon:") and _has("RssShmem:")), reason="needs /proc/self/status (Linux)")
def test_the_arena_is_private_memory_committed_at_construction():
    slots, slot_bytes = 2 * 8 + 1 + 2, 4 * MiB  # L = 2, C = 8, 1 scratch, 2 spares
    anon, shmem = _status("RssAnon:"), _status("RssShmem:")
    arena = SlotArena(2, 8, slot_bytes, torch.device("cpu"), scratch=1, spare=2)
    grown_anon, grown_shmem = _status("RssAnon:") - anon, _status("RssShmem:") - shmem
    assert arena.buffer.shape == (slots, slot_bytes) and arena.nbytes == slots * slot_bytes
    assert grown_shmem < 4 * MiB, grown_shmem / MiB  # not a shared (shmem) mapping
    assert grown_anon >= slots * slot_bytes - 4 * MiB, grown_anon / MiB  # committed now, not at a first touch
    assert int(arena.buffer.count_nonzero()) == 0
    arena.buffer[3].fill_(7)
    assert int(arena.buffer.sum()) == 7 * slot_bytes and arena.buffer.data_ptr() % 4096 == 0

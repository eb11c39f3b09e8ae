"""The optional numba backend of the compiled loops (:mod:`expertcache.cache.lru`,
:mod:`expertcache.routing.kernels`, :mod:`expertcache.models.fused`), in one place.

``AVAILABLE`` is False when numba is not installed or ``EXPERTCACHE_NO_NUMBA`` is set (to anything but
``0``); then :func:`jit` and :func:`jit_inline` return the function unchanged and callers take their
pure-Python paths, which make the same decisions. Compiled code is cached on disk (numba ``cache=True``).
"""

from __future__ import annotations

import os

try:
    import numba
except ImportError:  # pragma: no cover - exercised on installs without numba
    numba = None
if os.environ.get("EXPERTCACHE_NO_NUMBA", "") not in ("", "0"):
    numba = None

__all__ = ["AVAILABLE", "jit", "jit_inline", "jit_each"]

AVAILABLE = numba is not None


def _njit(fn, **options):
    try:
        return numba.njit(cache=True, nogil=True, **options)(fn)
    except RuntimeError:  # no writable cache location (read-only install, no user cache dir): compile per process
        return numba.njit(cache=False, nogil=True, **options)(fn)


def jit(fn):
    """Compile ``fn`` (nopython, no GIL, cached on disk where possible) when numba is available."""
    return _njit(fn) if numba is not None else fn


def jit_inline(fn):
    """For helpers called from other compiled loops: inlined there (no per-call argument passing)."""
    return _njit(fn, inline="always") if numba is not None else fn


def jit_each(make, keys) -> tuple:
    """One compiled function per key from one source: ``make(key)`` returns a function that closes over
    ``key``, which numba compiles as a constant, so branches on it are dropped (each specialisation runs
    only its own rule). Indexed by key (keys 0, 1, ...)."""
    return tuple(jit(make(key)) for key in keys)

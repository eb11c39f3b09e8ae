"""The int4 group fits of :func:`~expertcache.offload.quant.quantize_codes`: the least-squares scale and offset per
group (``optimize="lsq"``, the q4 / q4m presets), HQQ's zero refinement (``hqq``), and the final rounding of the
weights to codes under the stored scale and zero.

Two implementations of quantize_codes' int4 step (:func:`quantize_int4_torch`, :func:`quantize_int4`), which make
the same decisions:

- torch (:func:`lsq_torch`, :func:`codes_torch`: the reference, and the only path without numba,
  ``EXPERTCACHE_NO_NUMBA=1``): tensor ops over [N, K/G, G], a dozen full-size temporaries per step;
- compiled (when :data:`expertcache.compiled.AVAILABLE`): one numba loop per group over its G values for the ranges,
  the fit and the codes (``_range_rows``, ``_fit_rows``, ``_code_rows``), the per-group scale and zero steps between
  them in numpy on [N·K/G] vectors. The fit has the same candidates (:data:`SHRINKS`), steps (:data:`ITERS`) and
  tie-breaking (the first of equal errors), in float32 as torch's, but sums each group in float64 and rounds to
  float32 where torch sums in float32: a mean, covariance or error may differ in its last place, so a scale or
  offset may differ by an ulp and, rarely, a group takes another path (measured, [2048, 2048] Student-t(5), G =
  32 / 64 / 128: 0-7 codes of 4.2 M differ; 1 group of 33-131 k lands elsewhere, its error within ±8 %; the
  matrix's error within 2e-7 relative). Everything else -- the ranges, the rounding of s and z to the storage
  dtype, the codes ``clamp(round((w - z) / s) + 8, 0, 15)`` -- is the same float32 operations: min/max
  quantisation is bit-equal. tests/test_groupfit.py holds the tolerance.

quantize_codes' int8 step (:func:`quantize_int8`: the q4 preset's dense part and lm_head) is compiled the same
way, two passes per row (max |w|, then the codes), bit-equal to :func:`quantize_int8_torch`.

The compiled loops run without the GIL on a few threads (:func:`threads`; the caller's thread and kept helpers of a
``ThreadPoolExecutor``), each on its own block of rows (rows are independent, so the result does not depend on the
split), not on numba's parallel backend, whose spinning workers slowed torch's own ops beside them 50-100×.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from expertcache import compiled

__all__ = ["SHRINKS", "ITERS", "MAX_THREADS", "threads", "lsq_torch", "lsq", "codes_torch", "codes", "hqq_zero",
           "quantize_int4_torch", "quantize_int4", "quantize_int8_torch", "quantize_int8", "scales_zeros",
           "as_dtype"]

#: the candidate ranges of the least-squares fit (the min/max one, shrunk about its centre) and its steps per candidate
SHRINKS = (1.0, 0.9, 0.8)
ITERS = 3
#: at most this many threads for the compiled fits (:func:`threads`)
MAX_THREADS = 4
#: rows (groups) per thread below which one thread does the whole call (handing a block over costs tens of µs)
_MIN_ROWS = 2048
#: blocks per thread of a threaded call (:func:`_in_blocks`)
_BLOCKS_PER_THREAD = 4

_F0, _F2, _F7_5, _F8, _F15 = np.float32(0), np.float32(2), np.float32(7.5), np.float32(8), np.float32(15)
_F127 = np.float32(127)
_TINY, _EPS = np.float32(1e-12), np.float32(1e-6)  # torch's clamp(min=1e-12), var > 1e-6 / clamp(min=1e-6)


def threads() -> int:
    """Threads the compiled fits use: torch's intra-op count, capped by the CPUs this process may run on and by
    :data:`MAX_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cpus, MAX_THREADS))


def lsq_torch(w_NBG: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *, shrinks=SHRINKS,
              iters: int = ITERS) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares scale and offset per group (llama.cpp's ``make_qkx2_quants`` idea): from each candidate range
    (the min/max one, shrunk about its centre by ``shrinks``), alternate the codes (rounding, optimal for a given
    scale and offset) and the scale and offset (the linear regression of W on the codes, optimal for given codes):
    neither step raises the squared error. The candidate with the smallest error is kept per group (the first of
    equals). Returns (s, m) with ``W ≈ q·s + m``, q in [0, 15] (float32). About 8× the time of min/max in torch
    (3 candidates × 3 steps); more candidates gained little (Student-t(5) weights [2048, 2048], G = 64: relative
    error 0.1102 min/max, 0.1023 here, 0.1017 with 6 candidates × 4 steps at 4× this time). The reference of the
    compiled :func:`lsq`."""
    wm = w_NBG.mean(-1)
    wc = w_NBG - wm[..., None]  # centred once: cov(q, W) = mean(q · (W - mean W))
    best_err = best_s = best_m = None
    mid = (hi + lo) / 2
    for r in shrinks:
        s = ((hi - lo) * r / 15).clamp(min=1e-12)
        m = mid - 7.5 * s
        for _ in range(iters):
            q = torch.round((w_NBG - m[..., None]) / s[..., None]).clamp_(0, 15)
            qm = q.mean(-1)
            var = (q * q).mean(-1) - qm * qm
            cov = (q * wc).mean(-1)
            ok = var > 1e-6  # codes not all equal
            s = torch.where(ok, cov / var.clamp(min=1e-6), s).clamp(min=1e-12)
            m = torch.where(ok, wm - s * qm, m)
        q = torch.round((w_NBG - m[..., None]) / s[..., None]).clamp_(0, 15)
        err = (w_NBG - (q * s[..., None] + m[..., None])).pow_(2).sum(-1)
        if best_err is None:
            best_err, best_s, best_m = err, s, m
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
    return best_s, best_m


def _sum64(x):  # pragma: no cover - compiled (fastmath reassoc: the adds in any order, so they vectorise)
    """The float64 sum of float32 ``x`` [G]: the float32 values are exact in float64 and G ≤ 256 terms, so the order
    (the compiler's, vectorised) moves the sum by a few float64 ulps, far below the float32 it is rounded to."""
    acc = 0.0
    for j in range(x.shape[0]):
        acc += np.float64(x[j])
    return acc


def _fit_rows(w, lo, hi, shrinks, iters, s_out, m_out):  # pragma: no cover - compiled (its torch twin: lsq_torch)
    """:func:`lsq_torch` for the groups (rows) of ``w`` float32 [R, G], one pass per step over a group: writes
    s_out, m_out [R]. float32 arithmetic as torch's (each product and difference rounded to float32); the sums of
    those float32 values in float64 (:func:`_sum64`), rounded to float32 (torch's are float32)."""
    n_rows, g = w.shape
    gf = np.float32(g)
    wc = np.empty(g, np.float32)
    t = np.empty(g, np.float32)
    p = np.empty(g, np.float32)
    for i in range(n_rows):
        row = w[i]
        wm = np.float32(_sum64(row)) / gf
        for j in range(g):
            wc[j] = row[j] - wm
        l, h = lo[i], hi[i]
        mid = (h + l) / _F2
        best_err, best_s, best_m = _F0, _F0, _F0
        for c in range(shrinks.shape[0]):
            s = max((h - l) * shrinks[c] / _F15, _TINY)
            m = mid - _F7_5 * s
            for _ in range(iters):
                sq, sqq = 0, 0
                for j in range(g):
                    x = min(max(np.rint((row[j] - m) / s), _F0), _F15)
                    t[j] = x
                    p[j] = x * wc[j]
                    k = np.int32(x)
                    sq += k
                    sqq += k * k
                qm = np.float32(sq) / gf
                var = np.float32(sqq) / gf - qm * qm
                if var > _EPS:
                    s = max(np.float32(_sum64(p)) / gf / var, _TINY)
                    m = wm - s * qm
            for j in range(g):
                x = min(max(np.rint((row[j] - m) / s), _F0), _F15)
                d = row[j] - (x * s + m)
                p[j] = d * d
            err = np.float32(_sum64(p))
            if c == 0 or err < best_err:
                best_err, best_s, best_m = err, s, m
        s_out[i] = best_s
        m_out[i] = best_m


def _range_rows(w, lo, hi):  # pragma: no cover - compiled (torch: amin, amax)
    """Each row's minimum and maximum (one pass)."""
    n_rows, g = w.shape
    for i in range(n_rows):
        a = b = w[i, 0]
        for j in range(1, g):
            v = w[i, j]
            a = min(a, v)
            b = max(b, v)
        lo[i], hi[i] = a, b


def _code_rows(w, s, z, out):  # pragma: no cover - compiled (its torch twin: codes_torch)
    """int4 codes of ``w`` float32 [R, G] under each row's scale and zero: ``clamp(round((w - z) / s) + 8, 0, 15)``."""
    n_rows, g = w.shape
    for i in range(n_rows):
        si, zi = s[i], z[i]
        for j in range(g):
            out[i, j] = np.int32(min(max(np.rint((w[i, j] - zi) / si) + _F8, _F0), _F15))


def _absmax_rows(w, out):  # pragma: no cover - compiled (torch: w.abs().amax(dim=1))
    n_rows, k = w.shape
    for i in range(n_rows):
        a = _F0
        for j in range(k):
            a = max(a, abs(w[i, j]))
        out[i] = a


def _int8_rows(w, s, out):  # pragma: no cover - compiled (torch: round(w / s).clamp(-127, 127))
    n_rows, k = w.shape
    for i in range(n_rows):
        si = s[i]
        for j in range(k):
            out[i, j] = np.int32(min(max(np.rint(w[i, j] / si), -_F127), _F127))


if compiled.AVAILABLE:
    _absmax_rows = compiled.jit(_absmax_rows)
    _int8_rows = compiled.jit(_int8_rows)
    _sum64 = compiled.jit(_sum64, fastmath={"reassoc"})
    _fit_rows = compiled.jit(_fit_rows)
    _code_rows = compiled.jit(_code_rows)
    _range_rows = compiled.jit(_range_rows)


def _in_blocks(fn, n_rows: int, arrays, n_threads: int | None, *, min_rows: int = _MIN_ROWS) -> None:
    """``fn(*(a[r0:r1] for a in arrays))`` over blocks of rows, on ``n_threads`` threads (:func:`threads` if
    None, and one where the call has under ``min_rows`` rows a thread); every ndarray in ``arrays`` whose
    first axis is the rows is cut in blocks, anything else passes whole. :data:`_BLOCKS_PER_THREAD` blocks a
    thread, each thread taking the next block when done with one: a thread the OS holds back on a busy machine
    delays the call by one block, not by its share."""
    n = threads() if n_threads is None else max(1, n_threads)
    n = min(n, max(1, n_rows // min_rows)) if n_threads is None else min(n, max(1, n_rows))
    if n <= 1:
        fn(*arrays)
        return
    blocks = min(n_rows, n * _BLOCKS_PER_THREAD)
    bounds = [n_rows * t // blocks for t in range(blocks + 1)]
    todo = iter(range(blocks))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                t = next(todo, None)
            if t is None:
                return
            a, b = bounds[t], bounds[t + 1]
            fn(*(x[a:b] if isinstance(x, np.ndarray) and x.ndim and x.shape[0] == n_rows else x for x in arrays))

    futures = [_pool(n).submit(work) for _ in range(n - 1)]
    try:
        work()  # this thread works too
    finally:
        for f in futures:  # every block finished before the arrays are used (or an error raised)
            f.result()


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's helper threads: it starts its own
    os.register_at_fork(after_in_child=_POOLS.clear)


def _pool(n: int) -> ThreadPoolExecutor:
    """A pool of ``n - 1`` helper threads kept for the process (idle helpers wait on a queue: no spinning beside
    torch's threads); the caller's thread is the n-th."""
    with _POOL_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = ThreadPoolExecutor(n - 1, thread_name_prefix="expertcache-groupfit")
        return pool


def _rows(x: torch.Tensor, g: int | None = None) -> np.ndarray:
    x = x.detach().float().contiguous()
    return (x.reshape(-1, g) if g else x.reshape(-1)).numpy()


def lsq(w_NBG: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *, shrinks=SHRINKS, iters: int = ITERS,
        n_threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lsq_torch`'s (s, m) [N, K/G] float32, compiled where numba is (else that function): equal up to the
    float32 rounding of the per-group sums (module docstring). ``n_threads``: None = :func:`threads` (one where the
    call is small), else that many."""
    if not compiled.AVAILABLE:
        return lsq_torch(w_NBG, lo, hi, shrinks=shrinks, iters=iters)
    g = w_NBG.shape[-1]
    w = _rows(w_NBG, g)
    s = np.empty(w.shape[0], np.float32)
    m = np.empty(w.shape[0], np.float32)
    sh = np.asarray(shrinks, np.float32)
    _in_blocks(lambda *a: _fit_rows(*a[:3], sh, iters, *a[3:]), w.shape[0], (w, _rows(lo), _rows(hi), s, m), n_threads)
    shape = w_NBG.shape[:-1]
    return torch.from_numpy(s).view(shape), torch.from_numpy(m).view(shape)


def codes_torch(w_NBG: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """int32 codes [N, K/G, G]: ``clamp(round((w - z) / s) + 8, 0, 15)`` (float32 w, s, z)."""
    return (torch.round((w_NBG - z[..., None]) / s[..., None]) + 8).clamp(0, 15).to(torch.int32)


def codes(w_NBG: torch.Tensor, s: torch.Tensor, z: torch.Tensor, *, n_threads: int | None = None) -> torch.Tensor:
    """:func:`codes_torch`, in one compiled pass where numba is (bit-equal: the same float32 operations)."""
    if not compiled.AVAILABLE:
        return codes_torch(w_NBG, s, z)
    g = w_NBG.shape[-1]
    w = _rows(w_NBG, g)
    out = np.empty(w.shape, np.int32)
    _in_blocks(_code_rows, w.shape[0], (w, _rows(s), _rows(z), out), n_threads)
    return torch.from_numpy(out).view(w_NBG.shape)


def hqq_zero(w_NBG: torch.Tensor, s: torch.Tensor, z: torch.Tensor, *, iters: int = 20, p: float = 0.7,
             beta: float = 10.0, kappa: float = 1.01) -> torch.Tensor:
    """HQQ's half-quadratic refinement of the zero point (Badri & Shaji 2023, the hqq package's
    ``optimize_weights_proximal``), written for this kernel's form ``W ≈ (q - zq)·s``, ``zq = 8 - z/s``: alternate
    the codes (rounding), the error ``We`` (the proximal step of an l_p norm, p < 1: a generalised soft
    threshold that lets a few large errors be, so the rest get small) and the zero that makes ``W - We`` closest
    to the codes (a mean per group); the scale stays the min/max one. Returns the refined z (float32); the
    iteration whose mean |W - dequant| was smallest is kept, the min/max zero if none beat it."""
    zq = 8 - z / s
    q = torch.round(w_NBG / s[..., None] + zq[..., None]).clamp(0, 15)
    best = (w_NBG - (q - zq[..., None]) * s[..., None]).abs().mean(-1)
    best_zq = zq.clone()
    for _ in range(iters):
        q = torch.round(w_NBG / s[..., None] + zq[..., None]).clamp(0, 15)
        r = w_NBG - (q - zq[..., None]) * s[..., None]
        e = torch.sign(r) * torch.relu(r.abs() - (1 / beta) * r.abs().clamp(min=1e-12).pow(p - 1))
        zq = (q - (w_NBG - e) / s[..., None]).mean(-1)
        beta *= kappa
        q = torch.round(w_NBG / s[..., None] + zq[..., None]).clamp(0, 15)
        err = (w_NBG - (q - zq[..., None]) * s[..., None]).abs().mean(-1)
        better = err < best
        best, best_zq = torch.where(better, err, best), torch.where(better, zq, best_zq)
    return (8 - best_zq) * s


def quantize_int4_torch(w_NBG: torch.Tensor, dtype: torch.dtype, optimize: str) -> tuple[torch.Tensor, ...]:
    """(codes int32 [N, B, G], s, z [N, B] float32 holding ``dtype`` values) of float32 ``w_NBG``: the int4 part of
    :func:`~expertcache.offload.quant.quantize_codes` in torch ops (``optimize``: minmax, hqq or lsq)."""
    lo, hi = w_NBG.amin(dim=2), w_NBG.amax(dim=2)
    s = ((hi - lo) / 15).to(dtype).float()
    flat = s == 0  # a constant group: s = 1, z = its value, every q = 8
    s = torch.where(flat, torch.ones_like(s), s)
    z = lo + 8 * s
    if optimize == "hqq":
        z = hqq_zero(w_NBG, s, z)
    elif optimize == "lsq":
        s_ls, m_ls = lsq_torch(w_NBG, lo, hi)
        s = torch.where(flat, s, s_ls.to(dtype).float())
        s = torch.where(s == 0, torch.ones_like(s), s)
        z = m_ls + 8 * s
    z = torch.where(flat, lo, z).to(dtype).float()
    return codes_torch(w_NBG, s, z), s, z


def _rounder(dtype: torch.dtype):
    """float32 ndarray -> its values rounded to ``dtype`` (as float32), as torch's ``.to(dtype).float()``: round to
    nearest even; None for a dtype done in torch only."""
    if dtype == torch.float32:
        return lambda x: x
    if dtype == torch.float16:
        def fp16(x):
            with np.errstate(over="ignore"):  # beyond fp16's range: inf, as torch's
                return x.astype(np.float16).astype(np.float32)
        return fp16
    if dtype == torch.bfloat16:
        def bf16(x):  # c10::BFloat16's round_to_nearest_even on the bits (NaN -> 0x7FC0)
            u = x.view(np.uint32)
            r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
            return np.where(np.isnan(x), np.uint32(0x7FC00000), r).astype(np.uint32).view(np.float32)
        return bf16
    return None


def quantize_int4(w_NBG: torch.Tensor, dtype: torch.dtype, optimize: str, *,
                  n_threads: int | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`quantize_int4_torch`, compiled where numba is (``minmax`` and ``lsq``: the group ranges, the fit and
    the codes in compiled loops on :func:`threads` threads, the per-group scale and zero steps in numpy, which
    runs no threads of its own): the same float32 operations, so ``minmax`` is bit-equal and ``lsq`` equal up to
    the fit's float32 sums (:func:`lsq`). ``hqq`` and other dtypes: torch."""
    rnd = _rounder(dtype)
    if not compiled.AVAILABLE or optimize not in ("minmax", "lsq") or rnd is None:
        return quantize_int4_torch(w_NBG.float(), dtype, optimize)
    g = w_NBG.shape[-1]
    w = _rows(w_NBG, g)
    lo, hi = np.empty(w.shape[0], np.float32), np.empty(w.shape[0], np.float32)
    _in_blocks(_range_rows, w.shape[0], (w, lo, hi), n_threads)
    with np.errstate(all="ignore"):
        s = rnd((hi - lo) / _F15)
        flat = s == 0  # a constant group: s = 1, z = its value, every q = 8
        s = np.where(flat, np.float32(1), s)
        if optimize == "lsq":
            s_ls, m_ls = np.empty_like(s), np.empty_like(s)
            sh = np.asarray(SHRINKS, np.float32)
            _in_blocks(lambda *a: _fit_rows(*a[:3], sh, ITERS, *a[3:]), w.shape[0], (w, lo, hi, s_ls, m_ls), n_threads)
            s = np.where(flat, s, rnd(s_ls))
            s = np.where(s == 0, np.float32(1), s)
            z = m_ls + _F8 * s
        else:
            z = lo + _F8 * s
        z = rnd(np.where(flat, lo, z).astype(np.float32))
    s = s.astype(np.float32)
    q = np.empty(w.shape, np.int32)
    _in_blocks(_code_rows, w.shape[0], (w, s, z, q), n_threads)
    shape = w_NBG.shape[:-1]
    return torch.from_numpy(q).view(w_NBG.shape), torch.from_numpy(s).view(shape), torch.from_numpy(z).view(shape)


def quantize_int8_torch(w_NK: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int32 [N, K] in [-127, 127], s [N] float32 holding ``dtype`` values) of float32 ``w_NK``: ``s = max|w|
    / 127`` per row (1 for a zero row), ``q = round(w / s)``; quantize_codes' int8 step in torch ops."""
    s_N = (w_NK.abs().amax(dim=1) / 127).to(dtype).float()
    s_N = torch.where(s_N > 0, s_N, torch.ones_like(s_N))
    return torch.round(w_NK / s_N[:, None]).clamp(-127, 127).to(torch.int32), s_N


def quantize_int8(w_NK: torch.Tensor, dtype: torch.dtype, *, n_threads: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_int8_torch` in two compiled passes where numba is (bit-equal: the same float32 operations;
    the scale's rounding to ``dtype`` in numpy); else, and for other dtypes, that function."""
    rnd = _rounder(dtype)
    if not compiled.AVAILABLE or rnd is None or w_NK.dim() != 2 or 0 in w_NK.shape:
        return quantize_int8_torch(w_NK.float(), dtype)
    w = _rows(w_NK, w_NK.shape[1])
    amax = np.empty(w.shape[0], np.float32)
    rows = max(1, _MIN_ROWS * 64 // max(1, w.shape[1]))  # blocks of about as many values as the int4 loops'
    _in_blocks(_absmax_rows, w.shape[0], (w, amax), n_threads, min_rows=rows)
    with np.errstate(all="ignore"):
        s = rnd(amax / _F127)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    q = np.empty(w.shape, np.int32)
    _in_blocks(_int8_rows, w.shape[0], (w, s, q), n_threads, min_rows=rows)
    return torch.from_numpy(q), torch.from_numpy(s)


def scales_zeros(s_BN: torch.Tensor, z_BN: torch.Tensor) -> torch.Tensor:
    """``torch.stack([s_BN, z_BN], dim=-1)``, contiguous [B, N, 2] (the int4 kernels' scales-and-zeros), as a
    numpy copy of the bits: single-threaded, as the tensors are small, where torch's copy of strided inputs
    waits on its thread pool (7 ms for [32, 2048] on a busy 2-core machine)."""
    if s_BN.dtype != z_BN.dtype or s_BN.shape != z_BN.shape or s_BN.dtype.itemsize not in (2, 4):
        return torch.stack([s_BN, z_BN], dim=-1).contiguous()
    bits = torch.int16 if s_BN.dtype.itemsize == 2 else torch.int32
    out = np.stack([s_BN.view(bits).numpy(), z_BN.view(bits).numpy()], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out)).view(s_BN.dtype)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` (round to nearest even), for float32 ``x`` to bf16 / fp16 as a numpy conversion, which runs no
    thread pool (the small scale and zero vectors: a torch op on them waits on its pool on a busy machine)."""
    if x.dtype != torch.float32 or dtype == torch.float32:
        return x.to(dtype)
    if dtype == torch.bfloat16:
        bits = (_rounder(dtype)(x.contiguous().numpy()).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        return torch.from_numpy(bits).view(torch.bfloat16)
    if dtype == torch.float16:
        with np.errstate(over="ignore"):
            return torch.from_numpy(x.contiguous().numpy().astype(np.float16))
    return x.to(dtype)

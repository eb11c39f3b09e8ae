"""Our compiled kernels on torch's own CPU threads: one call split over ``n`` threads (:func:`run`) on the OpenMP
team torch's intra-op parallelism uses, so a decode step's numba products (the fused MoE step of ``q4moe.py``, the
q8x8 rows of ``q8x8.py``) and torch's products (FBGEMM's int8 projections, sdpa) share one set of threads.

Why not threads of our own: torch's OpenMP workers busy-wait for a while after each parallel region (libgomp's
spin before it sleeps), so a thread of ours started right after a torch op shares a core with a spinning worker,
and a torch op right after ours waits for workers it has to wake: on the 2-core AVX2 EPYC the 4 int8 attention
projections and the fused MoE step of one layer took *longer* with 2 threads than with 1 (8.9-10.2 vs 8.0-8.8 ms).
On torch's team the spinning worker takes the kernel's work at once.

**Contract** (:func:`run`): ``kernel`` is a C function ``void kernel(void *data)`` (a numba cfunc) whose ``data``
begins with an int64 work counter, 0 on the call; every thread of the team runs it, and each takes its units of
work by :func:`take` (an atomic fetch-and-add on the counter) until they run out; whichever thread computes a unit,
it writes its own outputs (disjoint memory), so the result is the one-thread result bit for bit, whatever the
threads' timing (and a thread that the OS deschedules leaves its share to the others). :func:`run` returns when
every thread is done (OpenMP's closing barrier: their writes are visible to the caller).

Where torch's runtime is OpenMP and its library (libgomp, or LLVM/Intel's libomp/libiomp5 with the GOMP entry
points) is found loaded (:func:`runtime`), the team is OpenMP's (``GOMP_parallel``); elsewhere a small persistent
pool of Python threads each calls the kernel through ctypes (which releases the GIL), the caller taking a share.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading

import torch

from expertcache import compiled

__all__ = ["runtime", "run", "cut", "take", "pointer"]

_LIB: list = []  # [the OpenMP library or None], once found
_KERNEL_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_NAMES = ("libgomp", "libiomp5", "libomp")


def _loaded_libraries() -> list[str]:
    """Paths of the OpenMP runtimes loaded in this process (Linux: /proc/self/maps), torch's own folder first."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[-1].strip() for line in f if ".so" in line}
    except OSError:
        return []
    found = [p for p in paths if os.path.basename(p).startswith(_NAMES)]
    torch_dir = os.path.dirname(torch.__file__)
    return sorted(found, key=lambda p: (not p.startswith(torch_dir), p))


def runtime():
    """The OpenMP library torch's intra-op threads run on (a ctypes CDLL with ``GOMP_parallel``), or None: torch's
    parallel backend is not OpenMP, none is found loaded, or the one found does not hold torch's thread count
    (``omp_get_max_threads`` of this thread against ``torch.get_num_threads``). Found once."""
    if not _LIB:
        got = None
        if "parallel backend: OpenMP" in torch.__config__.parallel_info():
            for path in _loaded_libraries():
                try:
                    lib = ctypes.CDLL(path)
                    par, most = lib.GOMP_parallel, lib.omp_get_max_threads
                except (OSError, AttributeError):
                    continue
                par.argtypes, par.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint], None
                most.argtypes, most.restype = [], ctypes.c_int
                if most() == torch.get_num_threads():
                    got = lib
                    break
        _LIB.append(got)
    return _LIB[0]


def cut(units: int, n: int) -> int:
    """The threads worth starting for ``units`` units of work and at most ``n`` threads (at least 1)."""
    return max(1, min(n, units))


def run(kernel: int, data: int, n: int) -> None:
    """Run the C function at address ``kernel`` on ``data`` (an address: int64 work counter first, 0) on ``n``
    threads, the caller's included (module docstring); with ``n`` = 1 a plain call on this thread."""
    if n <= 1:
        _KERNEL_PROTO(kernel)(data)
        return
    lib = runtime()
    if lib is not None:
        lib.GOMP_parallel(kernel, data, n, 0)
    else:
        fn = _KERNEL_PROTO(kernel)
        _POOL.run([lambda: fn(data)] * n)


class _Pool:
    """Persistent worker threads, each running the calls handed to it (a ctypes call: the GIL released)."""

    def __init__(self) -> None:
        self._jobs: list[queue.SimpleQueue] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()

    def run(self, calls: list) -> None:
        """Run ``calls`` (callables of no argument): the first here, the rest one per worker; return when all are
        done (the first error raised)."""
        with self._lock:
            while len(self._jobs) < len(calls) - 1:
                jobs: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=self._work, args=(jobs,), daemon=True, name="expertcache-team").start()
                self._jobs.append(jobs)
            for jobs, call in zip(self._jobs, calls[1:]):
                jobs.put(call)
            errors = []
            try:
                calls[0]()
            except BaseException as e:  # noqa: BLE001 - re-raised below, once the workers are done
                errors.append(e)
            for _ in calls[1:]:
                got = self._done.get()
                if got is not None:
                    errors.append(got)
            if errors:
                raise errors[0]

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while True:
            call = jobs.get()
            try:
                call()
                self._done.put(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._done.put(e)


_POOL = _Pool()

if compiled.AVAILABLE:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def take(typingctx, counter, at):
        """The next unit of work: an atomic fetch-and-add of 1 on ``counter[at]`` (an int64 array), its old value."""
        def codegen(context, builder, sig, args):
            arr = context.make_array(sig.args[0])(context, builder, args[0])
            ptr = builder.gep(arr.data, [args[1]])
            return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "seq_cst")
        return types.int64(counter, at), codegen

    def pointer(ty):
        """An intrinsic taking an int64 address to a ``CPointer(ty)`` (for ``carray``; ``ty`` a numba type)."""
        @intrinsic
        def to_pointer(typingctx, addr):
            def codegen(context, builder, sig, args):
                return builder.inttoptr(args[0], context.get_value_type(types.CPointer(ty)))
            return types.CPointer(ty)(addr), codegen
        return to_pointer

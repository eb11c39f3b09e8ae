"""Memory budget → expert-cache slots per layer.

``fast-tier bytes = non-expert weights + KV cache + I/O buffers + (L · C + X) · slot_bytes`` (L MoE layers,
C cache slots each, X extra slots shared by all layers: one scratch slot plus the prefetch spares,
:mod:`~expertcache.offload.slots`; ``slot_bytes`` is
one expert rounded up to whole pages plus the O_DIRECT alignment head/tail; I/O buffers are the reader
threads' bounce buffers when a layout needs them). Given a budget, C is the largest count that fits (at
most N). A budget below ``non-expert + KV + I/O + (L · K + X) · slot_bytes`` (K experts per token, every
layer) is refused with a :class:`BudgetError` that states that minimum. Sizes are those of the fast tier
(compute dtype for non-expert weights and KV, storage dtype -- bf16 or quantised -- for expert slots).
Everything the runtime allocates per run is in the plan.

**The process.** ``--memory`` budgets what the runtime allocates; the process around it also holds the
interpreter's own resident memory (Python, torch, transformers, the compiled kernels: measured, RSS at plan
time), the host-tier copy of every expert (``--tier host``) and the host cache (``--host-memory``), the page
cache a buffered tier keeps in flight, a fixed overhead for per-op temporaries and thread stacks
(:data:`RUNTIME_OVERHEAD`, pinned by a test against ``ru_maxrss``), and, before the slots exist, the
transient peak of loading (the largest non-expert tensor's read buffer, the quantised sidecar's one-expert
writer). :attr:`MemoryPlan.process_peak` is their sum at the worst moment. Inside a memory cgroup
(:func:`cgroup_memory_limit`: v1 ``memory.limit_in_bytes``, v2 ``memory.max``) a plan whose process peak
exceeds the limit is refused with the largest ``--memory`` that fits; ``--memory auto`` (:data:`AUTO`) plans
the largest budget whose process peak fits the limit (no limit: ``MemAvailable``).
Where int4 experts run on FBGEMM (AVX2: :mod:`~expertcache.offload.fbexperts`) each slot also holds its expert's
packed int8 copy: ``slot_bytes`` is then the slot's bytes plus that copy (``preflight.plan_from``'s ``slot_extra``).
With ``--resident-quant int4`` every expert's int4 copy is resident too: ``low_tier_bytes`` (L · N · the
packed blob's bytes) is one more fixed term, added to the total and the minimum.
``--memory minimum`` (:data:`MINIMUM`) asks for exactly that minimum: C = K.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from expertcache.container import cgroup_memory_limit  # noqa: F401 - read here by the runtime and the tests

__all__ = ["BudgetError", "MemoryPlan", "parse_bytes", "plan_memory", "format_bytes", "kv_cache_bytes", "MINIMUM",
           "AUTO", "cgroup_memory_limit", "container_limit", "process_rss", "RUNTIME_OVERHEAD"]

MINIMUM = -1
"""``parse_bytes('minimum')``: a budget of exactly the plan's minimum (K experts per layer), resolved by
:func:`plan_memory` once the model's sizes are known."""

AUTO = -2
"""``parse_bytes('auto')``: the largest budget whose process peak fits the memory cgroup's limit (or
``MemAvailable`` outside one), resolved by :func:`plan_memory` given ``limit``."""

RUNTIME_OVERHEAD = 64 * 2**20
"""Bytes a running process holds beyond its plan and its RSS at plan time (measured after the run's cache
and routing kernels are compiled: ``offload/preflight.py: compile_kernels``): per-op temporaries, torch's kernel
state touched on first use, reader-thread stacks, and a margin for the kernel's own charges to the cgroup.
Measured 18 MiB for a small OLMoE-shaped run decoding 16 tokens (tests/test_memory_plan.py pins the plan
against ``ru_maxrss``)."""


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


class BudgetError(ValueError):
    """The memory budget cannot hold the non-expert weights, the KV cache and K experts per layer."""


def parse_bytes(text: str | int) -> int:
    """``'3GiB'`` → 3221225472; accepts B, KB/MB/GB (10³), KiB/MiB/GiB (2¹⁰), plain byte counts, and
    ``'minimum'`` (→ :data:`MINIMUM`, the smallest budget the model runs in) and ``'auto'`` (→ :data:`AUTO`,
    the memory cgroup's limit)."""
    if isinstance(text, int):
        return text
    if str(text).strip().lower() in ("min", "minimum"):
        return MINIMUM
    if str(text).strip().lower() == "auto":
        return AUTO
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; use e.g. 3GiB, 512MiB, 2GB, a byte count, 'minimum' or 'auto'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def kv_cache_bytes(config, context: int, batch: int, dtype_bytes: int) -> int:
    """Keys and values of every attention layer for ``batch × context`` tokens."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * context * batch * dtype_bytes


def process_rss() -> int:
    """This process's resident memory now (bytes; ``/proc/self/statm``), 0 where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@functools.cache
def glibc():
    """The C library as a ``ctypes.CDLL`` where it is glibc on Linux (its malloc tunables), else None."""
    import ctypes
    import ctypes.util
    import platform

    name = ctypes.util.find_library("c")
    if not name or sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc's ``malloc_trim(0)``; nothing elsewhere). A
    transient phase that allocates and frees many blocks of a few MiB (the sidecar's writer: an expert's bytes,
    float32 copies, the packed blob) otherwise leaves them resident: glibc raises its mmap threshold to the
    size of each mmapped block freed, so the next ones come from the heap, whose free pages stay in RSS. That
    memory is in no term of the plan after the loading phase (measured: 20-50 MiB more peak RSS during a cold
    ``--quant int4`` run's decode than a warm one's). True if glibc returned memory."""
    libc = glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def container_limit(root: str | os.PathLike = "/") -> tuple[int | None, str]:
    """(bytes, where from) of the memory this process may grow to: its memory cgroup's limit, else (for
    ``--memory auto`` outside a cgroup) ``MemAvailable`` plus what it holds already; (None, why) if neither
    can be read."""
    n = cgroup_memory_limit(root)
    if n is not None:
        return n, "memory cgroup limit"
    try:
        for line in (Path(root) / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 + process_rss(), "MemAvailable + this process"
    except (OSError, ValueError, IndexError):
        pass
    return None, "no memory cgroup limit and no /proc/meminfo"


@dataclass(frozen=True)
class MemoryPlan:
    """How a budget is spent. ``slots`` is C (experts per layer in the fast tier). ``total``: what the runtime
    allocates (what ``--memory`` budgets); ``process_peak``: the whole process at its worst moment."""

    budget: int | None
    non_expert_bytes: int  # the dense (non-expert) weights in the form they are held (bf16, or --quant-dense)
    kv_bytes: int
    expert_bytes: int
    num_layers: int
    slots: int
    minimum: int
    slot_bytes: int = 0  # 0: = expert_bytes
    extra_slots: int = 0  # scratch + prefetch spares, shared by all layers
    io_bytes: int = 0
    host_bytes: int = 0  # the host-RAM level of a two-level cache (--host-memory; its own budget, not in total)
    host_slots: int = 0
    pinned_bytes: int = 0  # page-locked host memory of the host tier (CUDA runtimes; in host RAM, not in total)
    baseline_bytes: int = 0  # the interpreter's RSS at plan time (Python, torch, transformers, compiled kernels)
    load_bytes: int = 0  # transient while loading, beside the non-expert weights (read buffer, sidecar writer)
    page_cache_bytes: int = 0  # page cache a buffered tier keeps in flight
    host_tier_bytes: int = 0  # --tier host: every expert in host RAM
    overhead_bytes: int = 0  # per-op temporaries, thread stacks, kernels compiled on first use (RUNTIME_OVERHEAD)
    limit: int | None = None  # the container's limit the process peak was checked against (None: none)
    low_tier_bytes: int = 0  # every expert's resident low-precision copy (--resident-quant), fixed, in total

    @property
    def total(self) -> int:
        sb = self.slot_bytes or self.expert_bytes
        return (self.non_expert_bytes + self.kv_bytes + self.io_bytes + self.low_tier_bytes
                + (self.num_layers * self.slots + self.extra_slots) * sb)

    @property
    def beside(self) -> int:
        """Process bytes beside ``total`` while running: interpreter, host tier, host cache, page cache, overhead."""
        return (self.baseline_bytes + self.host_tier_bytes + self.host_bytes + self.page_cache_bytes
                + self.overhead_bytes)

    @property
    def loading_peak(self) -> int:
        """The process while loading, before any slot exists: interpreter + non-expert weights + transient."""
        return self.baseline_bytes + self.non_expert_bytes + self.load_bytes

    @property
    def process_peak(self) -> int:
        return max(self.loading_peak, self.beside + self.total)

    def describe(self) -> str:
        """One line: the budget's parts and the process peak (stderr of generate / bench)."""
        sb = self.slot_bytes or self.expert_bytes
        f = format_bytes
        return (f"memory plan: C={self.slots} slots/layer × {self.num_layers} layers × {f(sb)} + "
                f"{self.extra_slots} shared + non-expert {f(self.non_expert_bytes)} + KV {f(self.kv_bytes)}"
                f"{f' + I/O buffers {f(self.io_bytes)}' if self.io_bytes else ''} = {f(self.total)}; process peak "
                f"{f(self.process_peak)} (interpreter {f(self.baseline_bytes)}"
                f"{f', host tier {f(self.host_tier_bytes)}' if self.host_tier_bytes else ''}"
                f"{f', host cache {f(self.host_bytes)}' if self.host_bytes else ''}"
                f"{f', page cache {f(self.page_cache_bytes)}' if self.page_cache_bytes else ''}"
                f", overhead {f(self.overhead_bytes)}, loading peak {f(self.loading_peak)})"
                f"{f' within the limit {f(self.limit)}' if self.limit is not None else ''}")

    def to_dict(self) -> dict:
        return dict(asdict(self), total=self.total, total_with_host=self.total + self.host_bytes,
                    process_peak=self.process_peak)


def plan_memory(*, budget: int | None, slots: int | None, non_expert_bytes: int, kv_bytes: int, expert_bytes: int,
                num_layers: int, num_experts: int, top_k: int, slot_bytes: int | None = None, extra_slots: int = 0,
                io_bytes: int = 0, baseline_bytes: int = 0, load_bytes: int = 0, page_cache_bytes: int = 0,
                host_tier_bytes: int = 0, host_bytes: int = 0, overhead_bytes: int = 0,
                limit: int | None = None, limit_source: str = "memory limit", low_tier_bytes: int = 0) -> MemoryPlan:
    """Resolve ``budget`` (bytes) or an explicit ``slots`` count into a :class:`MemoryPlan`.

    Exactly one of ``budget`` / ``slots`` is given; ``budget=MINIMUM`` means the minimum itself (C = K),
    ``budget=AUTO`` the largest budget whose process peak fits ``limit``. ``slot_bytes`` (default
    ``expert_bytes``): the bytes of one slot; ``extra_slots``: scratch + prefetch slots shared by all layers;
    ``io_bytes``: reader buffers; ``low_tier_bytes``: the resident low-precision copies of every expert
    (``--resident-quant``), a fixed term beside the non-expert weights. The process terms (``baseline_bytes`` ... ``overhead_bytes``, see
    :class:`MemoryPlan`) do not count against ``budget``; with a ``limit`` (the container's, named
    ``limit_source`` in errors) the plan's :attr:`~MemoryPlan.process_peak` must fit it. Raises BudgetError
    (one line naming the minimum) when the budget is too small for K experts per layer or the process cannot
    fit the limit, or (naming the largest budget that fits) when this budget's process exceeds it; ValueError
    for slots outside [1, N] and for AUTO without a limit."""
    sb = slot_bytes or expert_bytes
    fixed = non_expert_bytes + kv_bytes + io_bytes + extra_slots * sb + low_tier_bytes
    minimum = fixed + num_layers * top_k * sb
    process = dict(baseline_bytes=baseline_bytes, load_bytes=load_bytes, page_cache_bytes=page_cache_bytes,
                   host_tier_bytes=host_tier_bytes, overhead_bytes=overhead_bytes, limit=limit)
    beside = baseline_bytes + host_tier_bytes + host_bytes + page_cache_bytes + overhead_bytes
    loading = baseline_bytes + non_expert_bytes + load_bytes
    parts = (f"non-expert weights {format_bytes(non_expert_bytes)} + KV cache {format_bytes(kv_bytes)} + K={top_k} "
             f"experts × {num_layers} layers (+ {extra_slots} shared scratch/prefetch) × {format_bytes(sb)}"
             f"{f' + I/O buffers {format_bytes(io_bytes)}' if io_bytes else ''}"
             f"{f' + low-precision copies {format_bytes(low_tier_bytes)}' if low_tier_bytes else ''}")
    if limit is not None and max(loading, beside + minimum) > limit:
        need = max(loading, beside + minimum)
        raise BudgetError(
            f"{limit_source} {format_bytes(limit)} is too small for this model: the process needs at least "
            f"{format_bytes(need)} ({need} bytes): interpreter {format_bytes(baseline_bytes)}"
            f"{f' + host tier {format_bytes(host_tier_bytes)}' if host_tier_bytes else ''}"
            f"{f' + host cache {format_bytes(host_bytes)}' if host_bytes else ''}"
            f"{f' + page cache {format_bytes(page_cache_bytes)}' if page_cache_bytes else ''}"
            f" + overhead {format_bytes(overhead_bytes)} + {parts}"
            f"{f'; loading peaks at {format_bytes(loading)}' if loading > beside + minimum else ''}")
    if budget == MINIMUM:
        budget = minimum
    elif budget == AUTO:
        if limit is None:
            raise ValueError("--memory auto: no memory limit to plan within (no memory cgroup limit, no "
                             "/proc/meminfo); give --memory a size")
        budget = limit - beside
    if (budget is None) == (slots is None):
        raise ValueError("give either a memory budget or a cache size in experts per layer, not both")
    if budget is not None:
        if budget < minimum:
            raise BudgetError(
                f"memory budget {format_bytes(budget)} is too small: {parts} need at least "
                f"{format_bytes(minimum)} ({minimum} bytes)")
        slots = min(num_experts, (budget - fixed) // (num_layers * sb))
    elif not 1 <= slots <= num_experts:
        raise ValueError(f"cache size (--cache-experts) must be between 1 and N={num_experts} experts per layer, got {slots}")
    plan = MemoryPlan(budget, non_expert_bytes, kv_bytes, expert_bytes, num_layers, int(slots), minimum,
                      slot_bytes or 0, extra_slots, io_bytes, host_bytes, 0, **process, low_tier_bytes=low_tier_bytes)
    if limit is not None and plan.process_peak > limit:
        fits = limit - beside
        c = min(num_experts, (fits - fixed) // (num_layers * sb))
        what = (f"--memory {format_bytes(budget)}" if budget is not None else f"C={slots} experts per layer")
        raise BudgetError(
            f"{what} does not fit the {limit_source} {format_bytes(limit)}: beside the plan's "
            f"{format_bytes(plan.total)} this process holds {format_bytes(beside)} (interpreter "
            f"{format_bytes(baseline_bytes)}, overhead {format_bytes(overhead_bytes)}"
            f"{f', host tier {format_bytes(host_tier_bytes)}' if host_tier_bytes else ''}"
            f"{f', host cache {format_bytes(host_bytes)}' if host_bytes else ''}"
            f"{f', page cache {format_bytes(page_cache_bytes)}' if page_cache_bytes else ''}); at most "
            f"--memory {format_bytes(fits)} ({fits} bytes, C={c}) fits: give that or --memory auto")
    return plan

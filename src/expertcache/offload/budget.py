"""Memory budget → expert-cache slots per layer.

``fast-tier bytes = non-expert weights + KV cache + I/O buffers + (L · C + X) · slot_bytes`` (L MoE layers,
C cache slots each, X extra slots shared by all layers: one scratch slot plus the prefetch spares,
:mod:`~expertcache.offload.slots`; ``slot_bytes`` is
one expert rounded up to whole pages plus the O_DIRECT alignment head/tail; I/O buffers are the reader
threads' bounce buffers when a layout needs them). Given a budget, C is the largest count that fits (at
most N). A budget below ``non-expert + KV + I/O + (L · K + X) · slot_bytes`` (K experts per token, every
layer) is refused with a :class:`BudgetError` that states that minimum. Sizes are those of the fast tier
(compute dtype for non-expert weights and KV, storage dtype -- bf16 or quantised -- for expert slots).
Everything the runtime allocates per run is in the plan; what is not (the Python interpreter, torch's
kernels and per-op temporaries, thread stacks) is a fixed overhead, pinned by a test.
With ``--resident-quant int4`` every expert's int4 copy is resident too: ``low_tier_bytes`` (L · N · the
packed blob's bytes) is one more fixed term, added to the total and the minimum.
``--memory minimum`` (:data:`MINIMUM`) asks for exactly that minimum: C = K.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

__all__ = ["BudgetError", "MemoryPlan", "parse_bytes", "plan_memory", "format_bytes", "kv_cache_bytes", "MINIMUM"]

MINIMUM = -1
"""``parse_bytes('minimum')``: a budget of exactly the plan's minimum (K experts per layer), resolved by
:func:`plan_memory` once the model's sizes are known."""

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


class BudgetError(ValueError):
    """The memory budget cannot hold the non-expert weights, the KV cache and K experts per layer."""


def parse_bytes(text: str | int) -> int:
    """``'3GiB'`` → 3221225472; accepts B, KB/MB/GB (10³), KiB/MiB/GiB (2¹⁰), plain byte counts, and
    ``'minimum'`` (→ :data:`MINIMUM`, the smallest budget the model runs in)."""
    if isinstance(text, int):
        return text
    if str(text).strip().lower() in ("min", "minimum"):
        return MINIMUM
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; use e.g. 3GiB, 512MiB, 2GB, a byte count or 'minimum'")
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


@dataclass(frozen=True)
class MemoryPlan:
    """How a budget is spent. ``slots`` is C (experts per layer in the fast tier)."""

    budget: int | None
    non_expert_bytes: int
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
    low_tier_bytes: int = 0  # every expert's resident low-precision copy (--resident-quant), fixed, in total

    @property
    def total(self) -> int:
        sb = self.slot_bytes or self.expert_bytes
        return (self.non_expert_bytes + self.kv_bytes + self.io_bytes + self.low_tier_bytes
                + (self.num_layers * self.slots + self.extra_slots) * sb)

    def to_dict(self) -> dict:
        return dict(asdict(self), total=self.total, total_with_host=self.total + self.host_bytes)


def plan_memory(*, budget: int | None, slots: int | None, non_expert_bytes: int, kv_bytes: int, expert_bytes: int,
                num_layers: int, num_experts: int, top_k: int, slot_bytes: int | None = None, extra_slots: int = 0,
                io_bytes: int = 0, low_tier_bytes: int = 0) -> MemoryPlan:
    """Resolve ``budget`` (bytes) or an explicit ``slots`` count into a :class:`MemoryPlan`.

    Exactly one of ``budget`` / ``slots`` is given; ``budget=MINIMUM`` means the minimum itself (C = K). ``slot_bytes`` (default ``expert_bytes``): the bytes of one
    slot; ``extra_slots``: scratch + prefetch slots shared by all layers; ``io_bytes``: reader buffers;
    ``low_tier_bytes``: the resident low-precision copies of every expert (``--resident-quant``), a fixed term
    beside the non-expert weights. Raises BudgetError
    (with the minimum) when the budget is too small for K experts per layer, ValueError for slots outside
    [1, N]."""
    sb = slot_bytes or expert_bytes
    fixed = non_expert_bytes + kv_bytes + io_bytes + extra_slots * sb + low_tier_bytes
    minimum = fixed + num_layers * top_k * sb
    if budget == MINIMUM:
        budget = minimum
    if (budget is None) == (slots is None):
        raise ValueError("give either a memory budget or a cache size in experts per layer, not both")
    if budget is not None:
        if budget < minimum:
            raise BudgetError(
                f"memory budget {format_bytes(budget)} is too small: non-expert weights "
                f"{format_bytes(non_expert_bytes)} + KV cache {format_bytes(kv_bytes)} + K={top_k} experts "
                f"× {num_layers} layers (+ {extra_slots} shared scratch/prefetch) × {format_bytes(sb)}"
                f"{f' + I/O buffers {format_bytes(io_bytes)}' if io_bytes else ''}"
                f"{f' + low-precision copies {format_bytes(low_tier_bytes)}' if low_tier_bytes else ''} need at least "
                f"{format_bytes(minimum)} ({minimum} bytes)")
        slots = min(num_experts, (budget - fixed) // (num_layers * sb))
    elif not 1 <= slots <= num_experts:
        raise ValueError(f"cache size (--cache-experts) must be between 1 and N={num_experts} experts per layer, got {slots}")
    return MemoryPlan(budget, non_expert_bytes, kv_bytes, expert_bytes, num_layers, int(slots), minimum,
                      slot_bytes or 0, extra_slots, io_bytes, low_tier_bytes=low_tier_bytes)

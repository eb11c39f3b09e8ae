"""Configuration of the offloaded runtime (defaults live here; the CLI reads them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EXPERT_PRODUCTS", "OffloadConfig"]

#: OffloadConfig.expert_product's choices
EXPERT_PRODUCTS = ("auto", "mv", "grouped_mm", "bmm")


@dataclass(frozen=True)
class OffloadConfig:
    """Where experts live, how many fit, and how they are read.

    tier: 'disk' (read the checkpoint on every miss) or 'host' (all experts in host RAM). io: disk reads,
    'direct' | 'fadvise' | 'cached' (see :mod:`expertcache.offload.store`). capacity: slots per layer C, or
    None to derive it from ``memory`` (bytes or '3GiB'); both None = every expert (C = N). quant: None,
    'int8' (per output channel) or 'int4' (group ``group`` in 32/64/128/256; None = 64 where it divides D and
    F, else 32 with K zero-padded, see :func:`~expertcache.offload.quant.default_group`), packed for torch's
    fused kernels; or a preset name (:data:`~expertcache.offload.quant.QUANT_PRESETS`: 'q4') standing for a quant,
    quant_dense and quant_opt. quant_opt: how int4 scales and zeros are chosen ('minmax', 'hqq', 'lsq':
    :func:`~expertcache.offload.quant.quantize_codes`). context, batch: the KV cache the budget reserves.
    readers: reader threads of the I/O queue (0 = every read on the compute thread, serial; None =
    :meth:`default_readers`). prefetch: spare slots shared by all layers for next-layer speculative prefetch
    (0 = off; they are part of the memory plan). host_memory: with ``tier='disk'``, the budget (bytes or
    '64MiB') of a host-RAM cache of expert bytes between the fast slots and the disk
    (:mod:`~expertcache.offload.tiers`; None or 0 = none, every miss reads the disk). quant_dense: None,
    'int8' or 'int4': the attention projections and lm_head through the fused kernels, the embedding as int8
    rows; 'int4-head8': attention and embedding int4, lm_head int8 (:mod:`~expertcache.offload.qlinear`; counted
    in the plan's non-expert bytes). compile: the dense
    part of every decoder layer (its norms and attention) through ``torch.compile`` (opt-in); batch-1
    ``generate`` then takes the captured decode step (:mod:`expertcache.models.captured`: static KV cache, a
    token's whole step one compiled graph, the experts computed in it from their slots where
    ``describe()["captured_experts"]`` says ``graph``; the routing policy and the cache step run the eager host
    code inside it, so the decisions are the eager ones up to the dense part's rounding). expert_product: how an
    eager one-token step's experts are computed -- 'mv' (two matrix-vector
    products per expert: the in-memory model's values bit for bit), 'grouped_mm' (one ``torch._grouped_mm``
    per matrix over the slot arena, empty groups for unused slots), 'bmm' (one batched product of the step's
    gathered matrices), 'auto' (:data:`EXPERT_PRODUCTS`: 'mv' on a CPU; on CUDA 'grouped_mm' for bf16 on
    compute capability 9.0 or later, else 'bmm').
    resident_quant: None or 'int4': every expert's copy in that precision (the fused kernels' layout) held in
    memory beside the full-precision slots (the plan's ``low_tier_bytes``), for misses served at low precision
    instead of loaded; low_threshold, load_budget, promote_after, low_cost: the per-miss rule
    (:class:`~expertcache.routing.precision.PrecisionRule`: threshold, budget, promote, cost).
    """

    tier: str = "disk"
    io: str = "direct"
    capacity: int | None = None
    memory: int | str | None = None
    quant: str | None = None
    group: int | None = None
    context: int = 2048
    batch: int = 1
    readers: int | None = None
    prefetch: int = 0
    host_memory: int | str | None = None
    quant_dense: str | None = None
    resident_quant: str | None = None
    low_threshold: float = 0.0
    load_budget: int | None = None
    promote_after: int = 0
    low_cost: float | None = None
    compile: bool = False
    expert_product: str = "auto"
    quant_opt: str = "minmax"

    def precision_rule(self):
        """The per-miss rule of these settings (no rule without a resident low-precision tier)."""
        from expertcache.routing.precision import NEVER, PrecisionRule

        if self.resident_quant is None:
            return NEVER
        return PrecisionRule(self.low_threshold, self.load_budget, self.promote_after, self.low_cost)

    #: reader threads where reads take long enough to overlap with compute (disk tier, GPU copies)
    PARALLEL_READERS = 4

    def default_readers(self, device) -> int:
        """Reader threads when none are given: 0 for ``tier='host'`` -- on a CPU a read is one memory copy of
        an expert (tens of microseconds) and handing it to a thread and back costs more than it overlaps
        (granular, C = 8, 16 rows a step: 11.8 ms a step inline against 17.0 ms with 4 readers, one thread);
        on CUDA it is one ``non_blocking`` copy from the pinned row queued on the copy stream, which returns at
        once (a thread would only hand the queueing off, and readers turn off the batched one-token path);
        :attr:`PARALLEL_READERS` for the disk tier, whose reads wait on the disk. ``device`` is accepted for
        callers that name it; the choice no longer depends on it."""
        if self.readers is not None:
            return self.readers
        return 0 if self.tier == "host" else self.PARALLEL_READERS

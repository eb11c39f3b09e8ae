"""The cache steps of the MoE layers: for one layer and one forward call, the cache's bookkeeping, the reads, the
computation and the next layer's guess (:class:`CacheSteps`; it knows nothing of transformers: the runtime,
:mod:`~expertcache.offload.runtime`, calls :meth:`CacheSteps.serve` from the model's experts seam).

One forward call at one MoE layer is one **step** of that layer's cache:

1. the routing (:mod:`~expertcache.offload.routes`) gives each token's ids and weights, against the *live*
   residency mask of this layer (all T tokens see the residency at the start of the step);
2. the step requests the union U of the selected experts, ordered by total router weight (descending; for
   one token: the token's own order), and ``cache.access_step(U)`` decides hits, misses and evictions;
3. **all misses are issued at once** to the reader threads (:mod:`~expertcache.offload.reads`), each into the
   slot freed by an evicted expert (a scratch slot if the cache does not keep it, only possible when U > C; a
   miss whose slot still holds a hit of this step is issued after the hits are computed); with ``prefetch`` on,
   layer ℓ+1's guess is issued next (:meth:`CacheSteps.guess_next`);
4. hits are computed from their slots (:mod:`~expertcache.offload.views`) while the misses are in flight; each
   miss is computed as it lands (with a resident low-precision tier, ``--resident-quant``, the misses the
   precision rule picks are left out of the cache step and computed from their low-precision copies instead:
   :meth:`CacheSteps._low_precision`);
5. per-expert outputs are combined in ascending expert id, as transformers' eager experts loop does --
   so the arrival order never changes the result.

The parts it is given (composition): the slot arena and its views, the reads, the observers, the host cache
level and the low-precision tier, and two functions of the routing: ``host_copy`` (a device tensor's kept host
copy) and ``guess`` (the next layer's guessed ids).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from expertcache.cache import ExpertCache
from expertcache.device import to_device
from expertcache.models.adapters import MoELayer
from expertcache.offload.layout import grouped_product, inline_product  # inline_product: re-exported
from expertcache.offload.observe import Observers
from expertcache.offload.prefetch import PrefetchStats
from expertcache.offload.reads import SlotReads
from expertcache.offload.slots import SlotArena, SlotPool
from expertcache.offload.views import SlotViews
from expertcache.routing.precision import PrecisionRule, serve_low, tier_costs

__all__ = ["LayerState", "CacheSteps", "inline_product", "union_order"]


def union_order(ids_TK: torch.Tensor, w_TK: torch.Tensor | None, num_experts: int) -> list[int]:
    """The experts one step requests (CPU ``ids_TK``, -1 slots skipped): one token's own order; for T > 1 the
    union of the rows' experts, by total weight ``w_TK`` (descending; ties by id; unused for one token). The one
    serving order: the runtime's step and the live view's shadow cache both read it from here."""
    if ids_TK.shape[0] == 1:
        return [e for e in ids_TK[0].tolist() if e >= 0]
    valid_TK = ids_TK >= 0
    total_E = torch.zeros(num_experts, dtype=torch.float32, device="cpu").index_add_(
        0, ids_TK[valid_TK], w_TK.to("cpu").float()[valid_TK])
    return sorted(set(ids_TK[valid_TK].tolist()), key=lambda e: (-float(total_E[e]), e))


@dataclass
class LayerState:
    """Runtime state of one MoE layer."""

    moe: MoELayer
    mlp: Callable
    cache: ExpertCache
    pool: SlotPool
    steps: list[list[int]] = field(default_factory=list)  # recorded union ids of single-token steps
    prefetched: int = 0
    guess: list[int] | None = None  # the pending next-layer guess for this layer
    io_wait: float = 0.0  # seconds the compute thread waited for this layer's reads
    low_computes: int = 0  # misses computed from the resident low-precision copies (--resident-quant)
    low_served: dict[int, int] = field(default_factory=dict)  # expert -> low-precision serves since its last load

    @property
    def act(self):
        """The ``linear`` layout's activation (weights (gate_up [2F, D], down [D, F])); None for others."""
        return getattr(self.mlp, "act", None)


class CacheSteps:
    """The cache steps of every MoE layer (see the module docstring). ``states``: one :class:`LayerState` per
    MoE layer (:meth:`reset`); ``new_cache()``: an empty cache of the configured eviction rule (after a failed
    read every layer restarts with one); ``host_copy(t)``: ``t`` in host memory (the routing's kept copy);
    ``guess(index, x_TD)``: the ids MoE layer ``index`` would select for ``x_TD`` (no state changes);
    ``prefetch_ahead``: spare slots for next-layer guesses (0: no guesses); ``grouped``: the one-token expert
    product (None: per-expert ``mv``; ``'grouped_mm'``, ``'bmm'``).

    Counters: ``compute_seconds`` (compute thread, reads' waits excluded), ``prefetch_stats``; the reads'
    waits are ``reads.io_wait_seconds``. ``slots_stable`` / ``slots_kept``: set by each step before its first
    expert is computed (no slot of the step is read into twice; and no read in flight either)."""

    def __init__(self, *, arena: SlotArena, views: SlotViews, reads: SlotReads, observers: Observers, host,
                 low, precision: PrecisionRule, num_experts: int, expert_bytes: int, prefetch_ahead: int,
                 grouped: str | None, new_cache: Callable[[], ExpertCache], host_copy: Callable,
                 guess: Callable[[int, torch.Tensor], list[int]]) -> None:
        self.arena, self.views, self.reads, self.observers = arena, views, reads, observers
        self.host, self.low, self.precision = host, low, precision
        self.num_experts, self.expert_bytes, self.prefetch_ahead = num_experts, expert_bytes, prefetch_ahead
        self.grouped, self.new_cache, self.host_copy, self.guess = grouped, new_cache, host_copy, guess
        self.states: list[LayerState] = []
        self.record = False  # record the union ids of single-token steps (LayerState.steps)
        self.slots_stable = False
        self.slots_kept = False
        self._guess_events: list[tuple] = []  # next-layer guesses made in the running step, for the observers
        self.reset([])

    def use_arena(self, arena: SlotArena, views: SlotViews) -> None:
        """Serve from a new arena (a new capacity) and its views; the caller resets the states after."""
        self.arena, self.views = arena, views

    def reset(self, states: list[LayerState]) -> None:
        """Start again with these layers' states (fresh caches); counters zeroed."""
        self.states = states
        self.compute_seconds = 0.0
        self.prefetch_stats = PrefetchStats()

    def drain(self) -> None:
        """Wait for every read in flight (errors ignored: the slots are about to be reset)."""
        self.reads.drain(self.arena)

    def miss_costs(self, index: int):
        """float32 [N]: the cost of loading each expert of layer ``index`` now, relative to the most expensive
        level (``cache-prior-cost``): 0 for a fast-slot resident, host seconds ÷ disk seconds for an expert
        the host cache holds (:meth:`HostCache.miss_costs`: measured bandwidths, priors before), 1 for a
        disk read. Without a host cache every miss costs 1 (= plain Cache-Prior). With a resident low-precision
        tier and a priced rule (``--low-cost``) no miss costs more than that price
        (:func:`~expertcache.routing.precision.tier_costs`)."""
        cost_E = np.ones(self.num_experts, np.float32)
        if self.host is not None:
            host_s, disk_s = self.host.miss_costs(self.expert_bytes)
            cost_E[self.host.resident_mask(index)] = min(1.0, host_s / disk_s)
        cost_E[self.states[index].cache.resident_array()] = 0.0
        return tier_costs(cost_E, self.precision)  # --resident-quant: a low-precision compute's price, if set

    def report_guesses(self) -> None:
        """The prefetch observers see the guesses made since the last report (the first layer's, made by the
        runtime's hook before its attention)."""
        for index, ids, issued in (self.take_guesses() if self._guess_events else ()):
            self.observers.notify_prefetch(index, "guess", ids, issued)

    # -- the MoE step ----------------------------------------------------------------------------

    def serve(self, index: int, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        st = self.states[index]
        t0, wait0 = time.perf_counter(), self.reads.io_wait_seconds
        ids_cpu_TK, order, low = self._requests(st, ids_TK, w_TK)
        if ids_cpu_TK.shape[0] == 1:
            final_TD = self._serve_one(st, x_TD, ids_TK, w_TK, order, low)
        else:
            final_TD = self._serve_many(st, x_TD, ids_TK, w_TK, order, ids_cpu_TK, low)
        self._book(st, t0, wait0)
        return final_TD

    def _requests(self, st: LayerState, ids_TK: torch.Tensor, w_TK: torch.Tensor
                  ) -> tuple[torch.Tensor, list[int], set[int] | tuple]:
        """(the ids in host memory, the step's serving order less the experts computed at low precision, those
        experts) for routed ids ``ids_TK`` and weights ``w_TK``; a one-token step's order is recorded."""
        # the host copy the router call fetched (the layer's one device -> host transfer) or that the routing
        # policy made these very ids from; a transfer of their own only for ids made otherwise (a row router's)
        ids_cpu_TK = self.host_copy(ids_TK)
        one = ids_cpu_TK.shape[0] == 1
        # the one serving order (the live view's shadow too); one token's needs no weights (no transfer)
        order = union_order(ids_cpu_TK, None if one else self.host_copy(w_TK), self.num_experts)
        if self.record and one:
            st.steps.append(list(order))
        low = self._low_precision(st, order, ids_cpu_TK, w_TK) if self.precision.active else ()
        if low:
            order = [e for e in order if e not in low]
        return ids_cpu_TK, order, low

    def _book(self, st: LayerState, t0: float, wait0: float) -> None:
        """Book a step begun at ``t0`` (io_wait_seconds then ``wait0``): its read waits and its compute time."""
        st.io_wait += self.reads.io_wait_seconds - wait0
        self.compute_seconds += time.perf_counter() - t0 - (self.reads.io_wait_seconds - wait0)

    def _low_precision(self, st: LayerState, order: list[int], ids_cpu_TK: torch.Tensor, w_TK: torch.Tensor
                       ) -> set[int]:
        """The requested experts the step computes from their resident low-precision copies
        (:func:`~expertcache.routing.precision.serve_low` on each expert's largest weight in the step, the
        cache's residency -- a prefetched spare counts as resident -- and its low-precision serves since its last
        load); updates those counts."""
        w_cpu_TK = w_TK.detach().to("cpu").float()
        if ids_cpu_TK.shape[0] == 1:
            of = dict(zip(ids_cpu_TK[0].tolist(), w_cpu_TK[0].tolist()))
            weight = [of[e] for e in order]
        else:
            valid = ids_cpu_TK >= 0
            top_E = torch.zeros(self.num_experts).scatter_reduce_(0, ids_cpu_TK[valid], w_cpu_TK[valid], "amax")
            weight = top_E[order].tolist()
        cache, served, spares = st.cache, st.low_served, st.pool.prefetched
        # a prefetched expert is in memory at full precision already: served from its spare, never at 4 bits
        lows = serve_low(order, weight, [e in cache or e in spares for e in order], self.precision,
                         expert_bytes=self.expert_bytes,
                         tokens=ids_cpu_TK.shape[0], low_served=[served.get(e, 0) for e in order])
        low = set()
        for e, is_low in zip(order, lows):
            if is_low:
                low.add(e)
                served[e] = served.get(e, 0) + 1
            elif e not in cache:  # loaded at full precision: its count starts again
                served.pop(e, None)
        st.low_computes += len(low)
        return low

    def _run_step(self, st: LayerState, order: list[int], compute, x_TD: torch.Tensor, low=()) -> None:
        try:
            seen = self._step(st, order, compute, x_TD) if order else self._no_step(st, x_TD, low)
        except BaseException:
            self._guess_events.clear()
            self.fail()
            raise
        # the observers after the step, outside its failure handling: an observer's error changes no state
        guesses = self.take_guesses() if self._guess_events else ()
        if seen is not None:
            self.observers.notify_step(st.moe.index, "demand", order, *seen, low=low)
        for index, ids, issued in guesses:
            self.observers.notify_prefetch(index, "guess", ids, issued)

    def _no_step(self, st: LayerState, x_TD: torch.Tensor | None, low) -> tuple | None:
        """Every expert of the step computed at low precision: no cache step, the next layer's guess all the same;
        (no hits, resident, resident) for the step observers, which see the low-precision ids."""
        self._guess_after(st, x_TD)
        if low and self.observers.step:
            resident = st.cache.resident()
            return [], resident, resident
        return None

    def take_guesses(self) -> list[tuple]:
        guesses, self._guess_events = self._guess_events, []
        return guesses

    def _serve_one(self, st: LayerState, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                   order: list[int], low: set[int] | tuple = ()) -> torch.Tensor:
        """One token ([1, D]), ``linear`` layout: the experts' matrix-vector products (two ``mv`` each, exactly
        the family's one-token MLP in :func:`~expertcache.offload.experts.expert_mlp`) with the activation
        batched over the step's U experts, when the step reads no slot twice (:attr:`slots_stable`; else each
        expert's MLP as its slot is ready, a scratch slot being reused for the next one; other layouts: the
        family's MLP per expert; q4x8 int4 experts with a SiLU gate: one fused call for the whole step,
        :mod:`~expertcache.offload.q4moe`, its own float32 sum). Then, batched: the routing weights and the
        combine -- in ascending expert id, each output added to a zero row in turn, the sums of transformers' experts loop (``index_add_``
        per expert), so the values are the per-expert path's bit for bit. About 3U + 14 tensor ops. The experts
        of ``low`` (not in ``order``) are computed from their low-precision copies and combined the same way."""
        x_D = x_TD[0]
        act = st.act
        fused = None if low else getattr(st.mlp, "fused", None)  # q4x8 experts: one call for the step (q4moe.py)
        h: dict[int, torch.Tensor] = {}
        ws: dict[int, tuple[torch.Tensor, ...]] = {}
        slots: dict[int, int] = {}

        def compute(e: int, slot: int) -> None:
            w = self.views.weights(st.moe.index, e, slot)
            if fused is not None and self.slots_stable:  # the views kept for one fused call when the step ends
                ws[e] = w
            elif act is not None and self.slots_stable:  # (set by _step before its first on_ready)
                ws[e] = w  # computed when the step ends, batched over its experts
                slots[e] = slot
            elif act is not None:
                gate_F, up_F = torch.mv(w[0], x_D).chunk(2)
                h[e] = torch.mv(w[1], act(gate_F) * up_F)
            else:
                h[e] = st.mlp(x_TD, w)[0]

        self._run_step(st, order, compute, x_TD, low)
        for e in low:
            h[e] = self.low.compute(st.moe.index, e, x_TD)[0]
        if fused is not None and ws:  # every expert of the step in one kernel call (its weighted sum included)
            return fused.step(x_D, ws, self.host_copy(ids_TK)[0].tolist(), w_TK[0])[None]
        grouped = self.views.per_matrix(list(ws.values())) if ws and not h and self.grouped is not None else None
        if grouped is not None:  # one grouped product per matrix over the step's slots (issue 35)
            return grouped_product(grouped, x_D, slots, self.host_copy(ids_TK)[0].tolist(), w_TK[0], act,
                                   self.grouped)[None]
        if ws:  # the same matrix-vector products; act(gate) * up row-wise (elementwise: the same values)
            es = sorted(ws)
            gate_UF, up_UF = torch.stack([torch.mv(ws[e][0], x_D) for e in es]).chunk(2, dim=-1)
            a_UF = act(gate_UF) * up_UF
            h_UD = torch.stack([torch.mv(ws[e][1], a_F) for e, a_F in zip(es, a_UF.unbind(0))])
            if h:  # the low-precision outputs beside them, in ascending expert id
                h.update(zip(es, h_UD.unbind(0)))
                es = sorted(h)
                h_UD = torch.stack([h[e] for e in es])
        else:
            es = sorted(h)
            h_UD = torch.stack([h[e] for e in es])
        # the routing weight of each expert, in ascending expert id (ids of one token are distinct; -1 sorts first)
        perm_U = ids_TK[0].argsort()[len(ids_TK[0]) - len(es):]
        hw_UD = (h_UD * w_TK[0, perm_U, None]).to(x_TD.dtype)
        final_D = torch.zeros_like(x_D)
        for hw_D in hw_UD.unbind(0):
            final_D.add_(hw_D)
        return final_D[None]

    def serve_slots(self, index: int, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache step of one token ([1, D]) whose experts the captured decode step computes in its graph:
        (slot [K] int64 on ``x_TD``'s device: the arena slot of each routed position's expert, -1 where the
        graph computes nothing, and rest [1, D]: the weighted sum of the experts computed here instead). The
        same step as :meth:`_serve` (bookkeeping, reads, the next layer's guess, observers), returning once every
        read has landed (the hits are not computed while the misses are read, as the eager step does); every
        expert is in the graph when the step reads no slot twice (:attr:`slots_kept`), else each is computed
        here as its slot is ready, as are the low-precision ones (``--resident-quant``)."""
        st = self.states[index]
        if ids_TK.shape[0] != 1:
            raise ValueError(f"the captured step serves one token, got {ids_TK.shape[0]}")
        t0, wait0 = time.perf_counter(), self.reads.io_wait_seconds
        ids_cpu_TK, order, low = self._requests(st, ids_TK, w_TK)
        slot_of: dict[int, int] = {}
        h: dict[int, torch.Tensor] = {}

        def compute(e: int, slot: int) -> None:
            if self.slots_kept:  # (set by _step before its first on_ready): in the graph, once every read landed
                slot_of[e] = slot
            else:
                h[e] = st.mlp(x_TD, self.views.weights(st.moe.index, e, slot))[0]

        self._run_step(st, order, compute, x_TD, low)
        for e in low:
            h[e] = self.low.compute(st.moe.index, e, x_TD)[0]
        ids_K = ids_cpu_TK[0].tolist()
        slot_K = torch.tensor([slot_of.get(e, -1) for e in ids_K], dtype=torch.long)
        rest_TD = torch.zeros_like(x_TD)
        for e in sorted(h):  # ascending expert id, as the eager combine
            rest_TD[0].add_((h[e] * w_TK[0, ids_K.index(e)]).to(x_TD.dtype))
        self._book(st, t0, wait0)
        return to_device(slot_K, x_TD.device), rest_TD

    def _serve_many(self, st: LayerState, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                    order: list[int], ids_cpu_TK: torch.Tensor, low: set[int] | tuple = ()) -> torch.Tensor:
        """T > 1 tokens: each expert's rows gathered and computed as its slot is ready; combined in ascending
        expert id (transformers' order). The (slot k, token) pairs of every expert come from one stable sort
        of the ids, slot-major -- for each expert the pairs ``torch.where((ids_TK == e).T)`` gives, in its
        order -- so a step costs the expert MLPs plus a gather and a scale per expert."""
        t_count = ids_TK.shape[0]
        flat_cpu = ids_cpu_TK.T.reshape(-1)  # position p = k * T + t: by slot k, then token
        pos = torch.argsort(flat_cpu, stable=True)
        ends = torch.bincount(flat_cpu + 1, minlength=self.num_experts + 1).cumsum(0).tolist()  # -1 sorts first
        pos = to_device(pos, ids_TK.device)
        tok_all = pos % t_count
        w_all = w_TK.T.reshape(-1)[pos]
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def compute(e: int, slot: int) -> None:
            a, b = ends[e], ends[e + 1]
            tok = tok_all[a:b]
            h = st.mlp(x_TD[tok], self.views.weights(st.moe.index, e, slot))
            out[e] = (tok, h * w_all[a:b, None])

        self._run_step(st, order, compute, x_TD, low)
        for e in low:  # computed from the resident low-precision copies
            a, b = ends[e], ends[e + 1]
            tok = tok_all[a:b]
            out[e] = (tok, self.low.compute(st.moe.index, e, x_TD[tok]) * w_all[a:b, None])
        final_TD = torch.zeros_like(x_TD)
        for e in sorted(out):
            tok, h = out[e]
            final_TD.index_add_(0, tok, h.to(final_TD.dtype))
        return final_TD

    def fail(self) -> None:
        """After a failed read: drain every read in flight and restart with empty caches (same policy)."""
        self.drain()
        if self.host is not None:
            self.host.reset()
        self.arena.reset()
        for st in self.states:
            st.cache = self.new_cache()

    def _guess_after(self, st: LayerState, x_TD: torch.Tensor | None) -> None:
        """The next MoE layer's guess from this step's input, once this step's reads are issued (prefetch on)."""
        if x_TD is not None and self.prefetch_ahead and st.moe.index + 1 < len(self.states):
            self.guess_next(st.moe.index + 1, x_TD)

    def _step(self, st: LayerState, order: list[int], on_ready: Callable[[int, int], None] | None,
              x_TD: torch.Tensor | None = None) -> tuple | None:
        """Serve one cache step for the requested ids ``order`` (descending weight): bookkeeping, all misses
        issued at once, the next layer's guess, hits computed (``on_ready(e, slot)``) while the misses are in
        flight, then each miss handed to ``on_ready`` as it lands. Returns (hits, resident before, resident
        after) for the step observers when there are any (the caller reports it), else None."""
        pool = st.pool
        if st.guess is not None:  # score the guess made for this step
            self.prefetch_stats.score(st.moe.index, st.guess, order)
            st.guess = None
        slot_of = pool.slot_of
        if all(e in slot_of for e in order):  # every request a hit: no read, no eviction, no slot changes hands
            self.slots_stable = self.slots_kept = True
            st.cache.access_step(order)
            if self.host is not None:
                self.host.touch(st.moe.index, order)
            self._guess_after(st, x_TD)
            if on_ready is not None:
                for e in order:
                    self._ready(st, slot_of[e], on_ready, e)
            if self.observers.step:
                resident = st.cache.resident()
                return [True] * len(order), resident, resident
            return None
        before = dict(pool.slot_of)
        hits = st.cache.access_step(list(order))
        if self.host is not None:  # fast hits refresh their host entries (the host level's LRU sees every use)
            self.host.touch(st.moe.index, [e for e, h in zip(order, hits) if h])
        after = st.cache.resident()
        for e in before:
            if e not in after:
                pool.free.append(pool.slot_of.pop(e))
        hit_slots = {before[e] for e, h in zip(order, hits) if h}
        self.arena.busy |= hit_slots  # one may turn into a spare below: no guess takes it before it is computed
        done: queue.SimpleQueue = queue.SimpleQueue()
        inflight: dict[int, int] = {}  # expert -> slot of misses whose read is (or will be) in flight
        deferred: list[tuple[int, int]] = []  # misses whose slot holds a hit of this step
        waiting_scratch: list[int] = []  # misses the cache does not keep, waiting for a scratch slot
        on_scratch: set[int] = set()
        landed: list[tuple[int, int]] = []  # misses already in memory (prefetched and complete)
        for e, hit in zip(order, hits):
            if hit:
                continue
            spare = pool.prefetched.get(e)
            if spare is not None:  # a prefetched copy: no read; it becomes the cache slot, a free slot a spare
                self._note_prefetch_used(e)
                if e in after:
                    self.arena.to_cache(spare, pool.free.pop())
                    pool.slot_of[e] = spare
                else:  # not kept: computed from the spare, which keeps it (no guess may take it this step)
                    self.arena.busy.add(spare)
                landed.append((e, spare))  # (its read, if still in flight, is waited for when computed)
                continue
            if e in after:
                slot = pool.free.pop()
                pool.slot_of[e] = slot
                if slot in hit_slots:
                    deferred.append((e, slot))
                    continue
            elif pool.scratch:
                slot = pool.scratch.pop()
                on_scratch.add(e)
            else:
                waiting_scratch.append(e)
                continue
            self.reads.submit(st, e, slot, done)
            inflight[e] = slot
        self._guess_after(st, x_TD)
        # no slot of this step is read into twice (no scratch rotation, no miss into a hit's slot): every
        # expert's slot keeps its bytes until the step ends, so on_ready may compute from it later -- when no
        # read is in flight either (serial reads are done already): else the hits are computed now, while the
        # misses are read
        self.slots_kept = not (deferred or on_scratch or waiting_scratch)
        self.slots_stable = self.slots_kept and \
            (not inflight or not self.reads.readers.readers)
        if on_ready is not None:
            for e, hit in zip(order, hits):
                if hit:
                    self._ready(st, before[e], on_ready, e)
        for e, slot in deferred:
            self.reads.submit(st, e, slot, done)
            inflight[e] = slot
        for e, slot in landed:
            self._ready(st, slot, on_ready, e)
        while inflight:  # each miss as it lands
            t0 = time.perf_counter()
            ticket = done.get()
            self.reads.io_wait_seconds += time.perf_counter() - t0
            e, slot = ticket.tag
            del inflight[e]
            self._ready(st, slot, on_ready, e)
            if e in on_scratch:  # computed: the scratch slot is free for the next expert the cache does not keep
                on_scratch.discard(e)
                if waiting_scratch:
                    nxt = waiting_scratch.pop(0)
                    on_scratch.add(nxt)
                    self.reads.submit(st, nxt, slot, done)
                    inflight[nxt] = slot
                else:
                    pool.scratch.append(slot)
        assert not waiting_scratch
        self.arena.busy.clear()
        assert set(pool.slot_of) == set(after), (sorted(pool.slot_of), sorted(after))
        if self.observers.step:
            return hits, before, after
        return None

    def _ready(self, st: LayerState, slot: int, on_ready, e: int) -> None:
        self.reads.ready(st.pool, slot)
        if on_ready is not None:
            on_ready(e, slot)

    def _note_prefetch_used(self, e: int) -> None:
        ps = self.prefetch_stats
        ps.used += 1
        ps.used_bytes += self.expert_bytes

    # -- next-layer speculative prefetch ---------------------------------------------------------

    def guess_next(self, index: int, x_TD: torch.Tensor) -> None:
        """Guess layer ``index``'s experts (:func:`~expertcache.offload.prefetch.guess_next_layer`) and read the
        non-resident guesses into the shared spare slots (:meth:`SlotArena.claim_spares`: empty ones first, then
        the oldest guess; never one whose read is in flight or that this step computes from). Never
        changes what is computed: a spare holds an expert's true bytes, used only if that expert is a miss.
        The prefetch observers see each guess (:class:`~expertcache.offload.observe.PrefetchEvent`, ``"guess"``)."""
        st = self.states[index]
        st.guess = ids = self.guess(index, x_TD)
        pool = st.pool
        want = [e for e in ids if e not in st.cache and e not in pool.prefetched]
        if not want:
            if self.observers.prefetch:  # reported after the step that made it (_run_step, _guess_first)
                self._guess_events.append((index, ids, []))
            return
        ps = self.prefetch_stats
        issued = []
        for e, slot in zip(want, self.arena.claim_spares(len(want))):
            self.arena.hold(slot, index, e)
            self.reads.submit(st, e, slot)
            ps.issued += 1
            ps.bytes += self.expert_bytes
            issued.append(e)
        if self.observers.prefetch:
            self._guess_events.append((index, ids, issued))

    def prefetch(self, index: int, experts: Iterable[int]) -> int:
        """Load ``experts`` of MoE layer ``index`` ahead of use (e.g. from a predictor). Each load is a cache
        step (eviction by the cache policy) counted as a prefetch, not as a demand hit or miss. At most C of
        them; already resident ones are skipped. Returns the number loaded. The step observers see its loads
        (``kind="prefetch"``), then the prefetch observers the call (``kind="explicit"``)."""
        st = self.states[index]
        guess, st.guess = st.guess, None
        experts = list(experts)
        loaded: list[int] = []
        steps: list[tuple] = []

        def load(ids: list[int]) -> None:
            loaded.extend(ids)
            try:
                seen = self._step(st, ids, lambda e, slot: None)
            except BaseException:
                self.fail()
                raise
            if seen is not None:
                steps.append((list(ids), seen))
        n = st.cache.prefetch(experts, load)
        st.guess = guess
        st.prefetched += n
        for ids, seen in steps:  # the observers once the runtime's state is final
            self.observers.notify_step(index, "prefetch", ids, *seen)
        if self.observers.prefetch:
            self.observers.notify_prefetch(index, "explicit", experts, loaded)
        return n


"""The offloaded MoE runtime: a transformers model whose experts live on a slow tier and are served from a
fixed number of fast-tier slots per layer.

Letter legend: B batch rows, S new tokens per row, T = B·S tokens of one forward call, E experts (N), K
experts per token, D hidden, F expert intermediate size, U experts requested by one step (the union), C
slots per layer.

Three parts with one seam each (STYLE.md "overlap is design"):

- **what to load** -- the routing policy (against the live residency, here), the cache's bookkeeping
  (``cache.access_step``: hits, misses, evictions) and the next-layer guess (:mod:`~expertcache.offload.step`);
- **loading it** -- :class:`~expertcache.offload.ioqueue.IOQueue` reader threads copying bytes from the tier
  into slots (:mod:`~expertcache.offload.slots`), knowing nothing of policies;
- **computing with it** -- :mod:`~expertcache.offload.experts` (views of a slot, the family's MLP).

Construction (:meth:`OffloadedModel.from_pretrained`) never loads the experts: the model skeleton is built
on the meta device, each MoE block's ``experts`` module is replaced by an
:class:`~expertcache.offload.experts.OffloadedExperts` (no weights), only the non-expert tensors are
materialised and read by key (:mod:`~expertcache.offload.loader`, loud), and rotary tables are recomputed.

One forward call at one MoE layer is one **step** of that layer's cache (:mod:`~expertcache.offload.step`:
bookkeeping, all misses issued at once, hits computed while they are in flight, the next layer's guess).

Contracts (pinned by tests): with ``original`` routing the logits equal the in-memory model's at every
capacity 1..N, for every family, with prefetch on and off, with 0, 1 and several reader threads; for
decoding (one token per step) the live hit/miss counts equal :func:`expertcache.sim.replay` of
:meth:`OffloadedModel.recorded_ids_TLK`; a damaged checkpoint or a missing expert key raises
:class:`~expertcache.offload.checkpoint.CheckpointError`; a read that fails in a reader thread raises its
``OSError``/``CheckpointError`` (naming the file) in the caller, never hangs, and leaves the runtime with
empty caches (as after :meth:`configure`).

Observing (:mod:`~expertcache.offload.observe`): step, prefetch and router observers see each cache step, each
read ahead and each routing as frozen events and cannot change a decision; :meth:`OffloadedModel.set_row_router`
is the one seam that may change the routing (the serve engine's per-request override). No other module
replaces a method of the runtime.

GPU: with ``device='cuda'`` slots are CUDA memory. A read is one ``non_blocking`` copy from pinned memory
into the slot on the runtime's copy stream (host tier: the expert's pinned row; disk tier and host cache: the
reader's pinned staging buffer after the read into it), ordered after the compute stream's earlier work on
that slot and before its next use by per-slot CUDA events (:meth:`LayerSteps._cuda_job`). Written for
issue 23 and covered by ``tests/test_gpu.py`` (``-m gpu``), not yet run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

from expertcache import __version__
from expertcache.device import on_host, to_device, to_host, to_host_many
from expertcache.cache import DEFAULT_GAMMA, CacheStats, eviction_rule, make_cache
from expertcache.models.adapters import Family, MoELayer, family_for, find_moe_layers, order_by_logits
from expertcache.models.captured import compile_dense, missing_compiler, unsupported_reason
from expertcache.models.cachearg import cache_kw, out_cache
from expertcache.offload.binding import bound_sidecar
from expertcache.offload.budget import (AUTO, RUNTIME_OVERHEAD, MemoryPlan, cgroup_memory_limit, container_limit,
                                       kv_cache_bytes, parse_bytes, plan_memory, process_rss, release_free_heap)
from expertcache.offload.checkpoint import Checkpoint, ExpertParts
from expertcache.offload.experts import OPAQUE_MATVEC_ELEMENTS, OffloadedExperts, bucket_rows, expert_mlp, use_matvec
from expertcache.offload.config import EXPERT_PRODUCTS, OffloadConfig
from expertcache.offload.ioqueue import IOQueue
from expertcache.offload.loader import cache_dir as _cache_dir
from expertcache.offload.loader import load_non_expert, recompute_rotary
from expertcache.offload.lowtier import LOW_MODES, LowPrecisionTier, low_tier_bytes
from expertcache.offload.prefetch import PrefetchStats
from expertcache.offload.qlinear import DENSE_MODES, dense_bytes, dense_kernel_note, dense_targets, quantize_dense_skeleton
from expertcache.offload.quant import (PACK_ROWS, cpu_description, kernel_choice_line, padding_note, quant_mlp,
                                       resolve_preset)
from expertcache.offload.slots import SlotArena, slot_bytes_for
from expertcache.offload.step import LayerState, LayerSteps
from expertcache.offload.tiers import HostCache, parse_host_memory
from expertcache.offload.store import (ALIGN, TIERS, DiskTier, HostTier, NativeSource, QuantSource, TierStats, place_expert,
                                       quant_layout_for, quant_sidecar_path, quantize_checkpoint)
from expertcache.models.loader import check_weights_match_config, load_config_checked, resolve_model_path
from expertcache.routing import Router, RoutingConfig
from expertcache.routing.precision import PrecisionRule, tier_costs
from expertcache.routing.registry import spec

__all__ = ["OffloadedModel", "OffloadedExperts", "OffloadConfig", "resolve_model_path"]

#: the quantised sidecar's writer holds one expert at a time: its bytes, float32 copies of its largest matrix
#: and their intermediates (quantize_matrix), the packed blob; a bound in units of the expert's stored bytes
#: (measured 4.8-8.9x for a 6 MiB float32 expert, int4 and int8: the heap's free blocks between experts and
#: the packing kernels' code pages on first use included)
SIDECAR_TRANSIENT = 9


#: ``--quant-dense`` packs each matrix a block of PACK_ROWS rows at a time, read straight from the checkpoint:
#: the block's bytes, its float32 copy, the padded copy, the int32 codes and the packed block; a bound in bytes
#: per element of one block (measured 12.9 per element when whole matrices were packed from float32)
DENSE_PACK_TRANSIENT = 13


def _sidecar(path: Path, checkpoint: Checkpoint, layers: list[MoELayer], layout) -> QuantSource:
    """The experts of ``checkpoint`` quantised to ``layout``: the sidecar next to the model if there is one, else
    one written once (streaming) into the cache folder, keyed by the checkpoint's files (never into the model
    folder)."""
    side = quant_sidecar_path(path, layout)
    if not bound_sidecar(side, checkpoint, [m.layer_id for m in layers]):  # absent, or made from another model
        import hashlib

        stamp = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                         for p in sorted({t.file for t in checkpoint.entries.values()}))
        key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
        side = quantize_checkpoint(checkpoint, [m.layer_id for m in layers], layout,
                                   out=_cache_dir() / "quant" / f"{path.name}-{key}-{side.name}")
    return QuantSource(side, layout)


def _check_resident_quant(offload: OffloadConfig, acts: list) -> None:
    """ValueError naming ``--resident-quant`` for a mode it does not take or an expert layout without one."""
    if offload.resident_quant not in LOW_MODES:
        raise ValueError(f"--resident-quant must be one of {', '.join(LOW_MODES)}, got {offload.resident_quant!r}")
    if offload.quant == offload.resident_quant:
        raise ValueError(f"--resident-quant {offload.resident_quant} beside --quant {offload.quant}: the slots "
                         "already hold that precision (use --quant none or int8 for the full-precision slots)")
    if any(a is None for a in acts):
        raise ValueError("--resident-quant needs gate_up/down experts (the 'linear' layout)")


def _expert_sizes(parts: dict, placement: dict, readers: int) -> tuple[int, int, int]:
    """(expert bytes, slot bytes, reader bounce-buffer bytes) of the experts ``parts`` placed as ``placement``."""
    bounce = [max(n for _, _, n, _, _ in p.spans) for p in placement.values() if p.bounce]
    return (next(iter(parts.values())).nbytes, slot_bytes_for(max(p.nbytes for p in placement.values())),
            (max(bounce) if bounce else 0) * max(1, readers))


def _graph_products(o: OffloadConfig, model: nn.Module, parts: ExpertParts, dtype: torch.dtype,
                    device: torch.device) -> bool:
    """Whether the captured decode step computes these experts in its graph (:func:`~expertcache.offload.step.
    inline_product`): ``compile`` on, a model the step takes, full-precision ``linear`` experts stored in the
    compute dtype, and on a CPU matrices under :data:`~expertcache.offload.experts.OPAQUE_MATVEC_ELEMENTS`
    (larger ones: aten's ``mv`` is faster there). Their disk reads then land at the packed layout (O_DIRECT
    through the bounce buffer: one copy per read), so that every slot holds its expert at one layout."""
    if not o.compile or o.quant or parts.layout != "linear" or parts.dtype != dtype:
        return False
    if on_host(device) and max(math.prod(shape) for _, shape in parts.tensors().values()) >= OPAQUE_MATVEC_ELEMENTS:
        return False
    return unsupported_reason(model) is None


def _expert_product(choice: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """The one-token expert product ``choice`` resolves to on ``device`` (None: 'mv', the per-expert products)."""
    if choice not in EXPERT_PRODUCTS:
        raise ValueError(f"expert_product must be one of {', '.join(EXPERT_PRODUCTS)}, got {choice!r}")
    if choice == "auto":
        if device.type != "cuda":
            return None
        capable = hasattr(torch, "_grouped_mm") and dtype == torch.bfloat16 and \
            torch.cuda.get_device_capability(device) >= (9, 0)
        return "grouped_mm" if capable else "bmm"
    return None if choice == "mv" else choice


class OffloadedModel(LayerSteps):
    """A causal LM with offloaded experts; see the module docstring. Build with :meth:`from_pretrained`."""

    def __init__(self, path: Path, model: nn.Module, family: Family, layers: list[MoELayer], checkpoint: Checkpoint,
                 offload: OffloadConfig, dtype: torch.dtype, device: torch.device, mlps: list[Callable],
                 process: dict | None = None) -> None:
        self.path = path
        self._process = process or {}  # the preflight's process terms (interpreter RSS, limit): see _preflight
        self.model = model
        self.config = model.config
        self.family = family
        self.layers = layers
        self.checkpoint = checkpoint
        self.offload = offload
        self.dtype = dtype
        self.device = device
        self.num_experts = layers[0].num_experts
        self.top_k = layers[0].top_k
        self.renormalize = bool(family.renormalize(layers[0].router))
        if offload.readers is None:  # recorded resolved: rows and descriptions name the threads that ran
            offload = self.offload = dataclasses.replace(offload, readers=offload.default_readers(device))
        if offload.prefetch < 0 or offload.readers < 0:
            raise ValueError(f"prefetch and readers must be >= 0, got {offload.prefetch}, {offload.readers}")
        acts = [getattr(f, "act", None) for f in mlps]
        if offload.quant:  # experts packed for the fused kernels (offload/quant.py); K padded where needed
            layout = quant_layout_for(checkpoint, layers[0].layer_id, offload.quant, offload.group, dtype, device,
                                      offload.quant_opt)
            offload = self.offload = dataclasses.replace(offload, group=layout.group if offload.quant == "int4" else None)
            mlps = [quant_mlp(layout, f.act) for f in mlps]
            self.source = _sidecar(path, checkpoint, layers, layout)
        else:
            self.source = NativeSource(checkpoint)
        low_source = None  # --resident-quant: every expert's low-precision copy, resident (offload/lowtier.py)
        if offload.resident_quant is not None:
            _check_resident_quant(offload, acts)
            low_layout = quant_layout_for(checkpoint, layers[0].layer_id, offload.resident_quant, None, dtype, device)
            low_source = _sidecar(path, checkpoint, layers, low_layout)
        self.precision = offload.precision_rule()
        # every expert present and well-formed before anything runs (loud); where its bytes go in a slot
        io = offload.io if offload.tier == "disk" else "cached"
        self._parts = {(m.index, e): self.source.parts(m.layer_id, e) for m in layers for e in range(self.num_experts)}
        # the captured step's in-graph products read every slot at one layout: disk reads land packed
        self.graph_experts = _graph_products(offload, model, next(iter(self._parts.values())), dtype, device)
        self._placement = {k: place_expert(p, io, packed=self.graph_experts) for k, p in self._parts.items()}
        self.expert_bytes, self.slot_bytes, self._io_bytes = _expert_sizes(self._parts, self._placement,
                                                                           offload.readers)
        self.readers = IOQueue(offload.readers)
        self.tier = DiskTier(offload.io) if offload.tier == "disk" else \
            HostTier(self.source, [m.layer_id for m in layers], self.num_experts, pin=device.type == "cuda")
        if isinstance(self.tier, DiskTier):  # open every file now: O_DIRECT support is checked before any run
            for f in sorted({r.file for p in self._parts.values() for r in p.reads}):
                self.tier.fd(f)
        host_budget = parse_host_memory(offload.host_memory)
        if host_budget and offload.tier != "disk":
            raise ValueError("--host-memory is the host-RAM level between the fast slots and the disk: it needs "
                             f"--tier disk (with --tier {offload.tier} every expert is in host RAM already)")
        self.host = HostCache(host_budget, self.slot_bytes, len(layers), self.num_experts, self.tier) \
            if host_budget else None  # the two-level cache (offload/tiers.py); None = every miss reads the disk
        self._low_bytes = 0 if low_source is None else \
            low_tier_bytes(low_source.quant, len(layers), self.num_experts)
        self.plan = self._plan()  # refused here, before the low-precision copies are loaded
        self.low = None if low_source is None else \
            LowPrecisionTier(low_source, [m.layer_id for m in layers], self.num_experts, device, acts)
        self.capacity = self.plan.slots
        self._mlps = mlps
        self._cuda = device.type == "cuda"
        self._staging = threading.local()  # CUDA: each reader's pinned staging buffer (disk tier, host cache)
        # CUDA: reads copy on their own stream; per slot, the event its copy waits for and the one compute waits for
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._slot_free: dict[int, object] = {}
        self._slot_ready: dict[int, object] = {}
        self._stalls: list[tuple] = []  # CUDA: (event before, event after) each compute-stream wait on a copy
        # the views of an expert in a slot depend on its layout there: one small id per distinct layout
        sigs: dict[tuple, int] = {}
        self._layout_of = {k: sigs.setdefault((tuple(p.at), tuple((r.dest, r.nbytes) for r in self._parts[k].reads),
                                               tuple(self._parts[k].tensors().items()), self._parts[k].dtype),
                                              len(sigs)) for k, p in self._placement.items()}
        self.slots_stable = False  # set by each step before its first expert is computed (step.py)
        self.slots_kept = False  # likewise: no slot of the step is read into twice (its experts' bytes stay)
        self._on_device = not on_host(device)  # CUDA (or the tests' device proxy): host copies are transfers
        self._host_copies: dict[int, tuple] = {}  # id(device tensor) -> (it, its host copy): _keep_host
        self._next_route: tuple | None = None  # (MoE layer index, its stock route) made ahead for its guess
        self._row_router: Callable | None = None  # set_row_router
        self.capturing = False  # True while a captured decode step runs (models/captured.py sets it)
        self._guess_events: list[tuple] = []  # next-layer guesses made in the running step, for the observers
        self.grouped = _expert_product(offload.expert_product, dtype, device)  # None: 'mv'
        self._make_pools(self.capacity)
        self._stock_routers = [m.router.forward for m in layers]
        self.routing = RoutingConfig()
        self.eviction = "lru"
        self.record = False
        self.configure()
        for m in layers:
            m.router.forward = self._make_router_forward(m, self._stock_routers[m.index])
        first = self.model.model.layers[layers[0].layer_id]  # its MoE layer's guess starts before its attention
        first.register_forward_pre_hook(self._guess_first, with_kwargs=True)

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, offload: OffloadConfig = OffloadConfig(), *,
                        dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                        routing: RoutingConfig | None = None, eviction: str = "lru", **configure_kw) -> "OffloadedModel":
        """Build the runtime for a checkpoint folder (or 'granular'/'coarse'). ``dtype`` defaults to the
        checkpoint's; ``device`` to CPU. ``routing``/``eviction``/``configure_kw`` go to :meth:`configure`."""
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(path)
        offload = resolve_preset(offload)  # --quant q4: the settings it stands for
        config = load_config_checked(path)  # sizes, top-k, field types: named, before anything is built
        family = family_for(config)  # every registered family declares its disk layout: all offload
        if offload.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {offload.tier!r}")
        if offload.compile and (why := missing_compiler()) is not None:
            raise ValueError(why)
        if offload.quant_dense not in (None, *DENSE_MODES):
            raise ValueError(f"--quant-dense must be one of {', '.join(DENSE_MODES)}, got {offload.quant_dense!r}")
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        device = torch.device(device or "cpu")
        _expert_product(offload.expert_product, dtype, device)  # a bad choice refused before anything is built
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        check_weights_match_config(path, config, model)  # config.json vs the safetensors shapes, named
        layers = find_moe_layers(model, family)
        checkpoint = Checkpoint(path, family.disk, layers[0].num_experts)
        layout = checkpoint.expert(layers[0].layer_id, 0).layout
        mlps = []
        for m in layers:
            mlps.append(expert_mlp(layout, m.block.experts))
            m.block.experts = OffloadedExperts(None, m.index)  # runtime bound below
        cls._compile_kernels(family, layers[0], routing or RoutingConfig(), eviction, configure_kw.get("gamma", 0.9))
        process = cls._preflight(path, model, layers, checkpoint, offload, dtype, device)  # refuses before loading
        packed = quantize_dense_skeleton(model, offload.quant_dense, device, compiled=offload.compile,
                                         optimize=offload.quant_opt)  # packed while loading
        model.to_empty(device=device)
        dense_load: dict = {}  # --quant-dense: packed weights read from / written to $EXPERTCACHE_CACHE/dense
        load_non_expert(model, checkpoint, config, packed, dense_cache=_cache_dir() / "dense", stats=dense_load)
        recompute_rotary(model, config, device)
        use_matvec(model)  # one-token linears as matrix-vector products (experts.py: 1.3× for bf16, same values)
        runtime = cls(path, model, family, layers, checkpoint, offload, dtype, device, mlps, process)
        runtime.dense_load = dense_load
        if (offload.quant or offload.quant_dense) and device.type == "cpu":  # which kernel on this CPU, and why
            print(f"expertcache: {kernel_choice_line(offload.quant, offload.quant_dense, compiled=offload.compile)}",
                  file=sys.stderr)
        if offload.compile:
            compile_dense(model)
        for m in layers:
            m.block.experts.bind(runtime)
        runtime.configure(routing=routing or RoutingConfig(), eviction=eviction, **configure_kw)
        release_free_heap()  # the loading phase's freed blocks (reads, packing, the sidecar's writer) leave RSS
        return runtime

    @staticmethod
    def _compile_kernels(family: Family, m: MoELayer, routing: RoutingConfig, eviction: str, gamma: float) -> None:
        """Compile (or load from numba's cache) the cache and routing kernels this run uses, before the
        interpreter's RSS is measured for the plan: compiling holds tens of MiB for the process's life
        (LLVM), which the first token would otherwise add beyond the plan. Nothing else changes: the
        runtime builds its own cache and router. A policy that needs inputs given later (ERAS's profile) or
        an offline eviction rule (refused by :meth:`configure`) is left to its first use."""
        n, k = m.num_experts, m.top_k
        try:
            make_cache(eviction, n, k, gamma=gamma, expert_bytes=1).access_step(list(range(k)))
            if routing.policy != "original":
                Router(routing, num_experts=n, k=k, renormalize=True, scoring=family.scoring).rank(
                    0, torch.zeros(1, n), torch.zeros(n, dtype=torch.bool), commit=False)
        except (ValueError, TypeError, RuntimeError):
            pass

    @classmethod
    def _preflight(cls, path: Path, model: nn.Module, layers: list[MoELayer], checkpoint: Checkpoint,
                   offload: OffloadConfig, dtype: torch.dtype, device: torch.device) -> dict:
        """The memory plan from the config and the safetensors headers alone, before any weight is read or
        any sidecar written: raises BudgetError (one line, the minimum) for a budget or a container that
        cannot hold this model, so a refusal never follows a large allocation. Measures the interpreter's
        RSS now (the process's baseline) and reads the container's limit; returns those process terms for
        the exact plan (:meth:`_plan`), whose slots are never larger than these upper bounds."""
        o = offload
        num_experts, readers = layers[0].num_experts, o.default_readers(device)
        ids = [m.layer_id for m in layers]
        if o.quant:  # the sidecar may not exist yet: its layout's bytes, at the worst file offset
            nbytes = quant_layout_for(checkpoint, ids[0], o.quant, o.group, dtype, device, o.quant_opt).nbytes
            expert_bytes, io_bytes = nbytes, 0
            slot_bytes = slot_bytes_for(nbytes) + (ALIGN if o.tier == "disk" and o.io == "direct" else 0)
        else:
            io = o.io if o.tier == "disk" else "cached"
            parts = {(m.index, e): checkpoint.expert(m.layer_id, e) for m in layers for e in range(num_experts)}
            packed = _graph_products(o, model, next(iter(parts.values())), dtype, device)
            expert_bytes, slot_bytes, io_bytes = _expert_sizes(
                parts, {k: place_expert(p, io, packed=packed) for k, p in parts.items()}, readers)
        dense = {} if o.quant_dense in (None, "none") else dense_targets(model)
        packed_keys = {k for name in dense for k in checkpoint.layout.disk_keys(f"{name}.weight")}
        largest = max((t.nbytes for k, t in checkpoint.entries.items()
                       if not checkpoint.is_expert_key(k) and k not in packed_keys), default=0)
        load = largest  # Checkpoint.tensor's read buffer beside the weights it is copied into
        if o.quant or o.resident_quant:  # the sidecar's writer, if it must be written (counted either way: a bound)
            load = max(load, SIDECAR_TRANSIENT * checkpoint.expert(ids[0], 0).nbytes)
        low = 0 if o.resident_quant is None else low_tier_bytes(
            quant_layout_for(checkpoint, ids[0], o.resident_quant, None, dtype, device), len(layers), num_experts)
        if dense:  # packed a block of rows at a time, straight from the checkpoint
            widest = max(m.weight.shape[1] for m in dense.values())
            load = max(load, DENSE_PACK_TRANSIENT * PACK_ROWS * widest)
        budget = None if o.memory is None else parse_bytes(o.memory)
        root = os.environ.get("EXPERTCACHE_CGROUP_ROOT", "").strip() or "/"  # a fake tree, for tests; "" = unset
        if budget == AUTO:
            limit, source = container_limit(root)
        else:
            limit, source = cgroup_memory_limit(root), "memory cgroup limit"
        process = dict(baseline_bytes=process_rss(), load_bytes=load, overhead_bytes=RUNTIME_OVERHEAD, limit=limit,
                       limit_source=source)
        cls._plan_from(model, o, dtype, process, dense_mode=o.quant_dense, expert_bytes=expert_bytes, slot_bytes=slot_bytes, io_bytes=io_bytes,
                       num_layers=len(layers), num_experts=num_experts, top_k=layers[0].top_k, readers=readers,
                       host_bytes=parse_host_memory(o.host_memory) if o.tier == "disk" else 0, low_tier_bytes=low)
        return process

    @staticmethod
    def _plan_from(model: nn.Module, o: OffloadConfig, dtype: torch.dtype, process: dict, *, dense_mode: str | None,
                   expert_bytes: int,
                   slot_bytes: int, io_bytes: int, num_layers: int, num_experts: int, top_k: int, readers: int,
                   host_bytes: int, low_tier_bytes: int = 0) -> MemoryPlan:
        """The plan of ``model`` under ``o`` with these expert sizes: ``dense_mode`` None for a loaded model
        (its tensors as they are), ``o.quant_dense`` for the meta skeleton (the same bytes, before loading)."""
        non_expert = dense_bytes(model, dense_mode)
        kv = kv_cache_bytes(model.config, o.context, o.batch, torch.empty((), dtype=dtype).element_size())
        budget = None if o.memory is None else parse_bytes(o.memory)
        slots = num_experts if budget is None and o.capacity is None else o.capacity  # both: plan_memory refuses
        buffered = o.tier == "disk" and o.io != "direct"  # reads through the page cache: in flight per reader
        return plan_memory(budget=budget, slots=slots, non_expert_bytes=non_expert, kv_bytes=kv,
                           expert_bytes=expert_bytes, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                           slot_bytes=slot_bytes, extra_slots=1 + o.prefetch, io_bytes=io_bytes,
                           page_cache_bytes=max(1, readers) * slot_bytes if buffered else 0,
                           host_tier_bytes=num_layers * num_experts * expert_bytes if o.tier == "host" else 0,
                           host_bytes=host_bytes, low_tier_bytes=low_tier_bytes, **process)

    def _plan(self) -> MemoryPlan:
        plan = self._plan_from(self.model, self.offload, self.dtype, self._process, dense_mode=None,
                               expert_bytes=self.expert_bytes,
                               slot_bytes=self.slot_bytes, io_bytes=self._io_bytes, num_layers=len(self.layers),
                               num_experts=self.num_experts, top_k=self.top_k, readers=self.offload.readers,
                               host_bytes=self.host.nbytes if self.host is not None else 0,
                               low_tier_bytes=self._low_bytes)
        if self.host is not None:  # the host level has its own budget (--host-memory), beside the fast tier's
            plan = dataclasses.replace(plan, host_slots=self.host.slots)
        return dataclasses.replace(plan, pinned_bytes=getattr(self.tier, "pinned_bytes", 0))

    def _make_pools(self, capacity: int) -> None:
        """One arena of C cache slots per layer plus one scratch slot and P spares shared by all layers."""
        self.arena = SlotArena(len(self.layers), capacity, self.slot_bytes, self.device, scratch=1,
                               spare=self.offload.prefetch)
        self._slot_views: dict[int, dict[int, tuple]] = {}  # slot -> layout id -> the expert tensors' views
        self._grouped_cache: dict[tuple, tuple] = {}  # the arena seen per matrix (step.py _grouped_views)
        self._inline_views = self._make_inline_views()  # the captured step's in-graph expert products (or None)
        # captured decode graphs bake in the arena: a new one needs new graphs
        self.model.__dict__.pop("_expertcache_captured", None)
        self.model.__dict__.pop("_expertcache_captured_warm", None)

    def route(self, m: MoELayer, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor, *,
              commit: bool = True):
        """(weights [T, K], ids [T, K]) that MoE layer ``m`` computes with for the stock router's output
        (logits ``z_TE``, weights ``w0_TK``, ids ``ids0_TK``): the row router's (:meth:`set_row_router`) if one
        is set, else the routing policy's (:meth:`route_policy`). ``commit=False``: see :meth:`route_policy`."""
        rows = self._row_router
        if rows is not None:
            return rows(m, z_TE, w0_TK, ids0_TK, commit=commit)
        return self.route_policy(m, z_TE, w0_TK, ids0_TK, commit=commit)

    def set_row_router(self, fn: Callable | None) -> None:
        """Route through ``fn(m, z_TE, w0_TK, ids0_TK, *, commit)`` instead of the routing policy (None: the
        policy again). The seam of a caller that routes some rows differently (the serve engine's per-request
        ``"policy": "original"``). Contract: ``fn`` returns (weights [T, K], ids [T, K]) on the devices and
        dtypes of ``w0_TK``/``ids0_TK``; it may call :meth:`route_policy` (at most once per call, passing
        ``commit`` on) and use the stock ``w0_TK``/``ids0_TK``; with ``commit=False`` (the next-layer guess) it
        must change nothing. It is called on the compute thread for every forward and guess at every layer."""
        if fn is not None and not callable(fn):
            raise TypeError(f"a row router must be callable, got {fn!r}")
        self._row_router = fn

    def stock_route(self, index: int, x_TD: torch.Tensor):
        """(logits [T, E], weights [T, K], ids [T, K]) of MoE layer ``index``'s own router for ``x_TD``, without
        the routing policy and without a cache step (the next-layer guess's first half). On a device, the
        next layer's guess was computed by the previous layer's router call and its host copy fetched with
        that layer's (:meth:`_fetch_host`): taken from there."""
        made, self._next_route = self._next_route, None
        if made is not None and made[0] == index:
            return made[1]
        return self._stock_routers[index](x_TD)

    def read_job(self, index: int, e: int, slot: int) -> Callable[[], int]:
        """The read of expert ``e`` of MoE layer ``index`` into ``slot``, as a reader thread runs it (returns the
        bytes read); not queued and not booked in any cache (the bandwidth probe of ``offload/bench.py``)."""
        return self._job(self.states[index], e, slot, self._placement[(index, e)])

    def route_policy(self, m: MoELayer, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor, *,
                     commit: bool = True):
        """(weights [T, K], ids [T, K]) of the routing policy for logits ``z_TE`` against the live residency.
        ``commit=False``: an observer's call (the next-layer guess), which leaves the router's running state
        (Cache-Prior's Δavg, a budget controller) as it was (:meth:`Router.rank`) and reads the ids only: the
        weights returned are then the stock ones, and the next step's ids are not touched."""
        if self.routing.policy == "original":
            return w0_TK, ids0_TK
        z_cpu_TE = self.host_copy(z_TE).detach()  # the layer's one device -> host transfer (or its copy)
        zr_TE, allowed_TE = self.family.ranking(m.router, z_cpu_TE)
        if self.routing.cache_aware:
            resident_TE = torch.from_numpy(self.states[m.index].cache.resident_array()).expand_as(zr_TE)
        else:
            resident_TE = torch.ones_like(zr_TE, dtype=torch.bool)
        if allowed_TE is not None:
            resident_TE = resident_TE & allowed_TE
        if spec(self.routing.policy).miss_costs:
            self.router.set_miss_costs(m.index, self.miss_costs(m.index))
        ids_TK = order_by_logits(self.router.rank(m.index, zr_TE, resident_TE, commit=commit), z_cpu_TE)
        ids_dev_TK = self._keep_host(to_device(ids_TK, ids0_TK.device), ids_TK)  # the step reads the host copy
        if not commit:
            return w0_TK, ids_dev_TK
        w_TK = self.family.weights(m.router, z_cpu_TE, ids_TK).to(w0_TK.dtype)
        return self._keep_host(to_device(w_TK, w0_TK.device), w_TK), ids_dev_TK

    # -- the host's copies (one device -> host transfer per MoE layer) ---------------------------

    def _keep_host(self, dev: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Remember ``host`` as the host copy of device tensor ``dev`` (until the next router call); ``dev``."""
        if dev is not host:
            self._host_copies[id(dev)] = (dev, host)
        return dev

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in host memory: its kept copy (:meth:`_fetch_host`, :meth:`route_policy`) when there is one,
        else a transfer of its own (a wait); ``t`` itself on the CPU."""
        kept = self._host_copies.get(id(t))
        if kept is not None and kept[0] is t:
            return kept[1]
        return to_host(t)

    def _fetch_host(self, m: MoELayer, x_TD: torch.Tensor, t: int | None, z_TE: torch.Tensor, w0_TK: torch.Tensor,
                    ids0_TK: torch.Tensor) -> None:
        """Device runs: bring what the host needs from this MoE layer's router in ONE transfer -- the ids
        (``original``) or the logits (a routing policy; both, and the weights, for a row router or T > 1) and,
        with prefetch on, the same of the next MoE layer's stock router applied to ``x_TD`` (its guess,
        :meth:`stock_route`), packed (:func:`~expertcache.device.to_host_many`)."""
        self._host_copies.clear()
        self._next_route = None
        rows = self._row_router is not None
        many = z_TE.shape[0] > 1
        original = self.routing.policy == "original"

        def wanted(z, w0, ids0):
            return ([z] if rows or not original else []) + ([ids0] if rows or original else []) + \
                ([w0] if many and (rows or original) else [])
        need = wanted(z_TE, w0_TK, ids0_TK)
        if self.offload.prefetch and m.index + 1 < len(self.layers):
            nxt = self._stock_routers[m.index + 1](x_TD)
            if t is not None:
                nxt = tuple(a[:t] for a in nxt)
            self._next_route = (m.index + 1, nxt)
            need += wanted(*nxt)
        for a, h in zip(need, to_host_many(*need)):
            self._keep_host(a, h)

    def miss_costs(self, index: int) -> np.ndarray:
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

    def _make_router_forward(self, m: MoELayer, stock):
        def forward(hidden_states, *args, **kwargs):
            if self.capturing and torch.compiler.is_compiling():  # traced by the captured step: an operator
                z_TE, w0_TK, ids0_TK = stock(hidden_states, *args, **kwargs)
                w_TK, ids_TK = torch.ops.expertcache.route(hidden_states, z_TE, w0_TK, ids0_TK, m.index)
                return z_TE, w_TK, ids_TK
            x_TD, t = bucket_rows(hidden_states) if hidden_states.dim() == 2 else (hidden_states, None)
            z_TE, w0_TK, ids0_TK = stock(x_TD, *args, **kwargs)
            if x_TD is not hidden_states:  # rows padded to a bucket as every linear's (offload/experts.py); per token
                z_TE, w0_TK, ids0_TK = z_TE[:t], w0_TK[:t], ids0_TK[:t]
            if self._on_device:
                self._fetch_host(m, x_TD, t if x_TD is not hidden_states else None, z_TE, w0_TK, ids0_TK)
            w_TK, ids_TK = self.route(m, z_TE, w0_TK, ids0_TK)
            if self._router_observers:
                self._notify_router(m.index, z_TE, ids_TK, w_TK)
            return z_TE, w_TK, ids_TK

        return forward

    # -- configuration ---------------------------------------------------------------------------

    def configure(self, *, routing: RoutingConfig | None = None, eviction: str | None = None, gamma: float = DEFAULT_GAMMA,
                  freq_LE: np.ndarray | torch.Tensor | None = None, record: bool | None = None,
                  capacity: int | None = None, precision: PrecisionRule | None = None) -> None:
        """(Re)start with a routing policy and fresh, empty caches (slots emptied, statistics zeroed).
        ``capacity`` re-sizes the fast tier to that many slots per layer (bypasses the memory plan).
        ``freq_LE`` None keeps the current ERAS-bias profile (so ``configure()`` only empties the caches).
        ``precision``: the per-miss rule (:class:`~expertcache.routing.precision.PrecisionRule`; None keeps the
        current one); a rule that can choose low precision needs the resident tier (``--resident-quant``)."""
        if precision is not None:
            if precision.active and self.low is None:
                raise ValueError("a low-precision rule (--low-threshold / --load-budget) needs --resident-quant int4")
            self.precision = precision
        self._drain()
        if capacity is not None and capacity != self.capacity:
            if not 1 <= capacity <= self.num_experts:
                raise ValueError(f"cache size must be between 1 and N={self.num_experts}, got {capacity}")
            self.capacity = capacity
            self._make_pools(capacity)
        self.routing = routing or self.routing
        self.eviction = eviction or self.eviction
        if eviction_rule(self.eviction).offline:
            raise ValueError(f"{self.eviction} needs the future requests; a live run cannot use it (replay a trace instead)")
        self.record = self.record if record is None else record
        freq = (getattr(getattr(self, "router", None), "freq_LE", None) if freq_LE is None
                else torch.as_tensor(np.asarray(freq_LE), dtype=torch.float32))
        self.router = Router(self.routing, num_experts=self.num_experts, k=self.top_k, renormalize=self.renormalize,
                             scoring=self.family.scoring, freq_LE=freq)
        self.gamma = gamma
        self.arena.reset()
        self.states = [LayerState(m, self._mlps[m.index],
                                  make_cache(self.eviction, self.num_experts, self.capacity, gamma=gamma,
                                             expert_bytes=self.expert_bytes), self.arena.pools[m.index])
                       for m in self.layers]
        self.tier.stats = TierStats()
        if self.host is not None:
            self.host.reset()
        self.compute_seconds = 0.0
        self.io_wait_seconds = 0.0
        self._stalls.clear()
        self.prefetch_stats = PrefetchStats()

    def warm(self, experts: Iterable[int] | None = None) -> None:
        """Load ``experts`` (default: the first C ids) into every layer, then zero all statistics."""
        ids = list(range(self.capacity)) if experts is None else list(experts)
        for li in range(len(self.layers)):
            self.prefetch(li, ids[: self.capacity])
        for st in self.states:
            st.cache.stats = CacheStats(self.num_experts)
            st.prefetched = 0
            st.low_computes = 0
        self.tier.stats = TierStats()
        if self.host is not None:  # keep the host entries the warm-up filled; zero its counters
            self.host.counts = type(self.host.counts)()
        self.io_wait_seconds = 0.0
        self._stalls.clear()
        self.prefetch_stats = PrefetchStats()

    def close(self) -> None:
        """Wait for reads in flight and stop the reader threads."""
        self._drain()
        self.readers.close()

    # -- generation ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids_BS: torch.Tensor, past=None, attention_mask=None):
        """One model forward (prefill or decode); returns the transformers output (logits, past_key_values)."""
        return self.model(input_ids=to_device(input_ids_BS, self.device), **cache_kw(past), use_cache=True,
                          attention_mask=attention_mask)

    def prefill(self, input_ids_BS: torch.Tensor):
        """(logits of the last position [B, V], KV cache) of the prompt."""
        from transformers import DynamicCache

        out = self.forward(input_ids_BS, DynamicCache(config=self.config))
        return out.logits[:, -1], out_cache(out)

    def decode_one_token(self, tok_B1: torch.Tensor, past):
        out = self.forward(tok_B1, past)
        return out.logits[:, -1], out_cache(out)

    def captured(self, rows: int, length: int):
        """A captured decode session (:class:`expertcache.models.captured.CapturedDecode`: static KV cache of
        ``length`` positions or more, the token's whole step one compiled graph; this runtime's seams its
        operators: :meth:`captured_route`, :meth:`captured_cache_step` / :meth:`captured_experts`)
        for a generation of ``rows`` rows, or None where :meth:`generate` decodes eagerly: ``compile`` off, more
        than one row, or a model of a layout it does not take (``captured_unsupported`` in :meth:`describe`)."""
        from expertcache.models.captured import CapturedDecode

        if not self.offload.compile or rows != 1 or unsupported_reason(self.model) is not None:
            return None
        guess = (self.layers[0].layer_id, self._guess_first_captured) if self.offload.prefetch else None
        return CapturedDecode(self.model, length, guess, owner=self)

    # -- the captured decode step's seams (models/captured.py: its operators call these) ----------

    def captured_key(self) -> tuple:
        """What the MoE blocks' traced code bakes in: whether the experts are computed in the graph."""
        return ("inline" if self._inline_views is not None else "experts",)

    def graph_products(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable] | None:
        """(the arena's per-matrix views, MoE layer ``index``'s activation) with which the captured step's graph
        computes that layer's experts (:func:`~expertcache.offload.step.inline_product`), or None where it does
        not (``describe()["captured_experts"]``)."""
        if self._inline_views is None:
            return None
        return self._inline_views, self._mlps[index].act

    def captured_route(self, x_TD: torch.Tensor, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor,
                       index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``expertcache::route``: the router seam's host part (:meth:`_make_router_forward` after the stock
        router): the device run's one transfer, the routing policy, the router observers; new tensors (an
        operator's outputs never alias its inputs), whose host copies are kept for the cache step."""
        m = self.layers[index]
        if self._on_device:
            self._fetch_host(m, x_TD, None, z_TE, w0_TK, ids0_TK)
        w_TK, ids_TK = self.route(m, z_TE, w0_TK, ids0_TK)
        if self._router_observers:
            self._notify_router(m.index, z_TE, ids_TK, w_TK)
        w_out, ids_out = w_TK.clone(), ids_TK.clone()
        if self._on_device:
            self._keep_host(ids_out, self.host_copy(ids_TK))
        return w_out, ids_out

    def captured_cache_step(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, index: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``expertcache::cache_step``: :meth:`~expertcache.offload.step.LayerSteps._serve_slots`."""
        return self._serve_slots(index, x_TD, ids_TK, w_TK)

    def captured_experts(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, index: int
                         ) -> torch.Tensor:
        """``expertcache::experts``: the eager experts seam (:meth:`_serve`)."""
        return self._serve(index, x_TD, ids_TK, w_TK)

    def _guess_first_captured(self, decoder_layer: nn.Module, h_11D: torch.Tensor) -> None:
        self._guess_first(decoder_layer, (h_11D,), {})

    @torch.inference_mode()
    def generate(self, input_ids_BS: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                 on_token: Callable[[torch.Tensor], None] | None = None, stop: int | None = None,
                 forced_BN: torch.Tensor | None = None, on_compile: Callable[[], None] | None = None) -> dict:
        """Greedy (``temperature=0``) or sampled decoding. Returns ``tokens`` [B, n], ``prefill_s``,
        ``decode_s`` (time of the decode steps only), ``decode_tokens`` (forward calls after the prefill) and
        ``decode_stats`` (hits, misses, bytes read ... of those calls only). ``on_token`` sees each new
        [B, 1] token as soon as it is chosen. ``forced_BN`` feeds those tokens instead of choosing (the
        benchmark's teacher-forced mode: a random-weight model decoded greedily repeats one token). With
        ``compile`` on, a one-row generation decodes through :meth:`captured`; ``compile_s`` is the time its
        graph took to compile (0 when this model already had it), counted in neither prefill nor decode, and
        ``on_compile()`` is called just before that compilation starts."""
        g = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        captured = self.captured(input_ids_BS.shape[0], input_ids_BS.shape[1] + max_new_tokens)
        if captured is not None:
            logits_BV, past = captured.prefill(input_ids_BS, on_compile), None
        else:
            logits_BV, past = self.prefill(input_ids_BS)
        t1 = time.perf_counter()
        s0 = self.stats()
        toks = []
        decode_s = 0.0
        for i in range(max_new_tokens):
            # one device -> host transfer per token: the greedy choice with the finiteness check packed beside
            # it, or (sampling with the host generator) the logits
            if forced_BN is not None:
                finite = bool(to_host(torch.isfinite(logits_BV).all()))
            elif temperature > 0:
                host_BV = to_host(logits_BV.float())
                finite = bool(torch.isfinite(host_BV).all())
            else:
                pick_B1 = torch.cat([logits_BV.float().argmax(dim=-1, keepdim=True),
                                     torch.isfinite(logits_BV).all().long().expand(logits_BV.shape[0], 1)], dim=1)
                pick_B1 = to_host(pick_B1)
                finite = bool(pick_B1[0, 1])
            if not finite:
                raise ValueError(f"non-finite logits (NaN/inf) at decode step {i}: the weights or activations of "
                                 f"{self.path} are not finite")
            if forced_BN is not None:  # teacher-forced continuation (benchmarks: same tokens for every policy)
                nxt_B1 = forced_BN[:, i:i + 1]
            elif temperature > 0:
                probs = torch.softmax(host_BV / temperature, dim=-1)
                nxt_B1 = torch.multinomial(probs, 1, generator=g)
            else:
                nxt_B1 = pick_B1[:, :1]
            toks.append(nxt_B1)
            if on_token is not None:
                on_token(nxt_B1)
            if (stop is not None and bool((nxt_B1 == stop).all())) or i == max_new_tokens - 1:
                break
            t = time.perf_counter()
            if captured is not None:
                logits_BV = captured.step(nxt_B1)
            else:
                logits_BV, past = self.decode_one_token(nxt_B1, past)
            decode_s += time.perf_counter() - t
        tokens = torch.cat(toks, dim=1) if toks else torch.zeros(input_ids_BS.shape[0], 0, dtype=torch.long)
        s1 = self.stats()
        d = {k: s1[k] - s0[k] for k in ("accesses", "hits", "misses", "low_computes", "bytes_read", "expert_loads",
                                         "io_seconds", "io_wait_seconds", "compute_seconds")}
        d["hit_rate"] = d["hits"] / d["accesses"] if d["accesses"] else 0.0
        compile_s = captured.compile_s if captured is not None else 0.0  # the step's graph, made after the prefill
        return dict(tokens=tokens, prefill_s=t1 - t0 - compile_s, decode_s=decode_s, decode_tokens=max(0, len(toks) - 1),
                    decode_stats=d, compile_s=compile_s)

    # -- results ---------------------------------------------------------------------------------

    def cache_stats(self) -> list[CacheStats]:
        return [st.cache.finish() for st in self.states]

    def stats(self) -> dict:
        """Hits (full precision), misses (loads), ``low_computes`` (misses computed from the resident
        low-precision copies instead, ``--resident-quant``; not in accesses), hit rate, bytes read from the tier (demand misses and prefetches), reads, read
        seconds (summed over reader threads), seconds the compute thread waited for reads, compute seconds,
        prefetch counters (:class:`PrefetchStats`). Waits for reads in flight first, so counts are final."""
        for t in self.arena.tickets():
            t.join()
        if self._stalls:  # pragma: no cover - GPU only: the device-side copy waits, timed by CUDA events
            self._stalls[-1][1].synchronize()
            self.io_wait_seconds += sum(a.elapsed_time(b) for a, b in self._stalls) / 1e3
            self._stalls.clear()
        per = self.cache_stats()
        total = functools.reduce(CacheStats.merge, per)
        host = self.host.counts if self.host is not None else None
        tiers = None
        if host is not None:  # where each access was served: fast slot, host-RAM cache, disk
            tiers = dict(fast_hits=total.hits, **host.to_dict(), host_slots=self.host.slots,
                         host_budget=self.host.budget)
        return dict(accesses=total.accesses, hits=total.hits, misses=total.misses, hit_rate=total.hit_rate,
                    evictions=total.evictions,
                    bytes_read=self.tier.stats.bytes_read + (host.host_bytes if host else 0),
                    expert_loads=self.tier.stats.loads + (host.host_hits if host else 0),
                    io_seconds=self.tier.stats.seconds + (host.host_busy_seconds if host else 0.0), tiers=tiers,
                    io_wait_seconds=self.io_wait_seconds, compute_seconds=self.compute_seconds,
                    prefetched=sum(st.prefetched for st in self.states), prefetch=self.prefetch_stats.to_dict(),
                    low_computes=sum(st.low_computes for st in self.states),
                    per_layer_misses=[s.misses for s in per],
                    per_layer_low_computes=[st.low_computes for st in self.states],
                    per_layer_io_wait_seconds=[st.io_wait for st in self.states])

    def recorded_ids_TLK(self) -> np.ndarray:
        """[T, L, K] ids of the recorded single-token steps (``configure(record=True)``), for
        :func:`expertcache.sim.replay`."""
        steps = [st.steps for st in self.states]
        n = {len(s) for s in steps}
        if len(n) != 1:
            raise RuntimeError(f"layers recorded different step counts {sorted(n)}")
        t = n.pop()
        out = np.full((t, len(steps), self.top_k), -1, dtype=np.int32)
        for li, s in enumerate(steps):
            for ti, ids in enumerate(s):
                out[ti, li, :len(ids)] = ids
        return out

    def describe(self) -> dict:
        """Resolved configuration (JSON-serialisable) for result rows."""
        return dict(version=__version__, model=str(self.path), model_type=self.family.model_type,
                    num_experts=self.num_experts, top_k=self.top_k, moe_layers=len(self.layers),
                    dtype=str(self.dtype).replace("torch.", ""), device=str(self.device), tier=self.offload.tier,
                    host_slots=self.host.slots if self.host is not None else 0,
                    io=self.offload.io if self.offload.tier == "disk" else None, quant=self.offload.quant,
                    quant_dense=self.offload.quant_dense, resident_quant=self.offload.resident_quant,
                    precision=self.precision.to_dict() if self.low is not None else None,
                    group=self.offload.group if self.offload.quant else None, capacity=self.capacity,
                    quant_kernel=padding_note(self.source.quant) if self.source.quant is not None else None,
                    dense_kernel=dense_kernel_note(self.model), dense_load=getattr(self, "dense_load", {}),
                    quant_opt=self.offload.quant_opt,
                    cpu=cpu_description(),
                    expert_bytes=self.expert_bytes, memory=self.plan.to_dict(), routing=self.routing.to_dict(),
                    eviction=self.eviction, gamma=eviction_rule(self.eviction).settings(gamma=self.gamma).get("gamma"),
                    readers=self.readers.readers, prefetch=self.offload.prefetch, slot_bytes=self.slot_bytes,
                    compile=self.offload.compile, expert_product=self.grouped or "mv",
                    captured_unsupported=self._captured_unsupported(),
                    captured_experts=self._captured_experts(), threads=torch.get_num_threads())

    def _captured_experts(self) -> str | None:
        """Where the captured decode step computes a token's experts: ``"graph"`` (in its compiled code,
        :func:`~expertcache.offload.step.inline_product`) or ``"eager"`` (the eager products, one operator per
        MoE block); None where it does not run (``compile`` off, or a model it does not take)."""
        if not self.offload.compile or self._captured_unsupported() is not None:
            return None
        return "graph" if self._inline_views is not None else "eager"

    def _captured_unsupported(self) -> str | None:
        """Why ``compile`` does not take the captured decode step for this model (None: it does, or compile is off)."""
        return unsupported_reason(self.model) if self.offload.compile else None

"""The offloaded MoE runtime: a transformers model whose experts live on a slow tier and are served from a
fixed number of fast-tier slots per layer.

Letters: B batch rows, S new tokens per row, T = B·S tokens of one forward, E experts (N), K experts per token,
D hidden, F expert intermediate size, U experts requested by one step (the union), C slots per layer.

:class:`OffloadedModel` assembles parts that each do one job (composition; STYLE.md "overlap is design"), and
is the only one that knows transformers' model object (it installs the hooks):

- **which experts** -- :class:`~expertcache.offload.routes.Routes`: the routing policy against the live
  residency, a row router, the host's copies of the router outputs;
- **what to load** -- :class:`~expertcache.offload.step.CacheSteps`: the cache's bookkeeping
  (``cache.access_step``: hits, misses, evictions), the next-layer guess, the computation of one step;
- **loading it** -- :class:`~expertcache.offload.reads.SlotReads` over the
  :class:`~expertcache.offload.ioqueue.IOQueue` reader threads, copying bytes from the tier
  (:mod:`~expertcache.offload.store`, :mod:`~expertcache.offload.tiers`) into slots
  (:mod:`~expertcache.offload.slots`), knowing nothing of policies;
- **computing with it** -- :mod:`~expertcache.offload.views` and :mod:`~expertcache.offload.layout` (views of a
  slot, the products), :mod:`~expertcache.offload.experts` (the family's MLP);
- **observing it** -- one :class:`~expertcache.offload.observe.Observers` registry handed to the parts;
- functions it calls: the memory plan before loading (:mod:`~expertcache.offload.preflight`), the decode loop
  (:mod:`~expertcache.offload.generate`), the counters (:mod:`~expertcache.offload.stats`).

Construction (:meth:`OffloadedModel.from_pretrained`) never loads the experts: the skeleton is built on the meta
device, each MoE block's ``experts`` becomes an :class:`~expertcache.offload.experts.OffloadedExperts` (no weights),
only the non-expert tensors are read by key (:mod:`~expertcache.offload.loader`, loud), rotary tables recomputed.

Contracts (pinned by tests): with ``original`` routing the logits equal the in-memory model's at every
capacity 1..N, for every family, with prefetch on and off, with 0, 1 and several reader threads; for
decoding (one token per step) the live hit/miss counts equal :func:`expertcache.sim.replay` of
:meth:`OffloadedModel.recorded_ids_TLK`; a damaged checkpoint or a missing expert key raises
:class:`~expertcache.offload.checkpoint.CheckpointError`; a read that fails in a reader thread raises its
``OSError``/``CheckpointError`` (naming the file) in the caller, never hangs, and leaves the runtime with
empty caches (as after :meth:`configure`).

Observers (:mod:`~expertcache.offload.observe`) see frozen events and cannot change a decision;
:meth:`OffloadedModel.set_row_router` is the one seam that may change the routing. No module replaces a method.
GPU: ``device='cuda'`` slots are CUDA memory, filled by copies on their own stream (:mod:`.reads`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import functools
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

from expertcache import __version__
from expertcache.cache import DEFAULT_GAMMA, CacheStats, ExpertCache, eviction_rule, make_cache
from expertcache.device import on_host, to_device
from expertcache.models.adapters import Family, MoELayer, family_for, find_moe_layers
from expertcache.models.captured import CapturedDecode, compile_dense, missing_compiler, unsupported_reason
from expertcache.models.cachearg import cache_kw, out_cache
from expertcache.models.loader import check_weights_match_config, load_config_checked, resolve_model_path
from expertcache.offload.binding import bound_sidecar
from expertcache.offload.capture import CapturedSeams
from expertcache.offload.budget import MemoryPlan, release_free_heap
from expertcache.offload.checkpoint import Checkpoint
from expertcache.offload.config import OffloadConfig
from expertcache.offload.experts import OffloadedExperts, bucket_rows, expert_mlp, use_matvec
from expertcache.offload.fbexperts import slot_copy_bytes, slot_mlps
from expertcache.offload.generate import generate
from expertcache.offload.ioqueue import IOQueue
from expertcache.offload.loader import cache_dir as _cache_dir, load_non_expert, recompute_rotary, use_disk_embedding
from expertcache.offload.lowtier import LowPrecisionTier, low_tier_bytes
from expertcache.offload.observe import ObserverHandle, Observers, PrefetchEvent, RouterEvent, StepEvent
from expertcache.offload.prefetch import PrefetchStats, first_layer_input, guess_next_layer
from expertcache.offload.preflight import check_resident_quant, compile_kernels, expert_product, expert_sizes, graph_products, plan_from, preflight  # noqa: E501
from expertcache.offload.kernelnote import say_kernels
from expertcache.offload.hostnorm import use_host_norms
from expertcache.offload.qlinear import DENSE_MODES, dense_kernel_note, quantize_dense_skeleton
from expertcache.offload.quant import cpu_description, padding_note, resolve_preset
from expertcache.offload.reads import SlotReads
from expertcache.offload.routes import Routes
from expertcache.offload.slots import SlotArena
from expertcache.offload.stats import recorded_ids, runtime_stats
from expertcache.offload.step import CacheSteps, LayerState
from expertcache.offload.store import TIERS, DiskTier, HostTier, NativeSource, QuantSource, TierStats, place_expert, quant_layout_for, quant_sidecar_path, quantize_checkpoint  # noqa: E501
from expertcache.offload.tiers import HostCache, parse_host_memory
from expertcache.offload.views import SlotViews, layout_ids
from expertcache.routing import RoutingConfig
from expertcache.routing.precision import PrecisionRule

__all__ = ["OffloadedModel", "OffloadedExperts", "OffloadConfig", "resolve_model_path"]


def _sidecar(path: Path, checkpoint: Checkpoint, layers: list[MoELayer], layout) -> QuantSource:
    """``checkpoint``'s experts quantised to ``layout``: the sidecar beside the model if made from it (binding.py),
    else one written once (streaming) into the cache folder, keyed by the checkpoint's files (never its folder)."""
    side = quant_sidecar_path(path, layout)
    if not bound_sidecar(side, checkpoint, [m.layer_id for m in layers]):  # absent, or made from another model
        stamp = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                         for p in sorted({t.file for t in checkpoint.entries.values()}))
        key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
        side = quantize_checkpoint(checkpoint, [m.layer_id for m in layers], layout,
                                   out=_cache_dir() / "quant" / f"{path.name}-{key}-{side.name}")
    return QuantSource(side, layout)


def _load(cls, path: str | os.PathLike, offload: OffloadConfig, *, dtype: torch.dtype | None,
          device: str | torch.device | None, routing: RoutingConfig | None, eviction: str,
          **configure_kw) -> "OffloadedModel":
    """:meth:`OffloadedModel.from_pretrained`: the skeleton on the meta device, the config and the plan checked,
    the experts replaced by :class:`OffloadedExperts`, the non-expert weights loaded by key, then ``cls(...)``."""
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
    expert_product(offload.expert_product, dtype, device)  # a bad choice refused before anything is built
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    check_weights_match_config(path, config, model)  # config.json vs the safetensors shapes, named
    layers = find_moe_layers(model, family)
    checkpoint = Checkpoint(path, family.disk, layers[0].num_experts)
    use_disk_embedding(model, checkpoint, config, device, dtype, compiled=offload.compile)  # rows read on demand
    layout = checkpoint.expert(layers[0].layer_id, 0).layout
    mlps = [expert_mlp(layout, m.block.experts) for m in layers]
    for m in layers:
        m.block.experts = OffloadedExperts(None, m.index)  # runtime bound below
    compile_kernels(family, layers[0], routing or RoutingConfig(), eviction, configure_kw.get("gamma", 0.9), offload, device)
    process = preflight(path, model, layers, checkpoint, offload, dtype, device)  # refuses before loading
    packed = quantize_dense_skeleton(model, offload.quant_dense, device, compiled=offload.compile,
                                     optimize=offload.quant_opt)  # packed while loading
    model.to_empty(device=device)
    dense_load: dict = {}  # --quant-dense: packed weights read from / written to $EXPERTCACHE_CACHE/dense
    load_non_expert(model, checkpoint, config, packed, dense_cache=_cache_dir() / "dense", stats=dense_load)
    recompute_rotary(model, config, device)
    use_matvec(model)  # one-token linears as matrix-vector products (experts.py: 1.3× for bf16, same values)
    runtime = cls(path, model, family, layers, checkpoint, offload, dtype, device, mlps, process)
    runtime.dense_load, runtime.host_norms = dense_load, use_host_norms(model) if offload.quant_dense and device.type == "cpu" and not offload.compile else 0  # noqa: E501 -- one-token RMSNorms in one call each where the products differ from transformers' anyway (hostnorm.py)
    if (offload.quant or offload.quant_dense) and device.type == "cpu":  # which kernel on this CPU, and why
        say_kernels(offload.quant, offload.quant_dense, compiled=offload.compile, norms=runtime.host_norms)
    if offload.compile:
        compile_dense(model)
    for m in layers:
        m.block.experts.bind(runtime)
    runtime.configure(routing=routing or RoutingConfig(), eviction=eviction, **configure_kw)
    release_free_heap()  # the loading phase's freed blocks (reads, packing, the sidecar's writer) leave RSS
    return runtime


class OffloadedModel:
    """A causal LM with offloaded experts; see the module docstring. Build with :meth:`from_pretrained`.

    Its parts (public, each with its own small surface): ``routes`` (:class:`Routes`), ``steps``
    (:class:`CacheSteps`), ``reads`` (:class:`SlotReads`), ``views`` (:class:`SlotViews`), ``observers``
    (:class:`Observers`), and the store: ``source``, ``tier``, ``host`` (the host-RAM level or None), ``low``
    (the resident low-precision tier or None), ``readers`` (:class:`IOQueue`)."""

    def __init__(self, path: Path, model: nn.Module, family: Family, layers: list[MoELayer], checkpoint: Checkpoint,
                 offload: OffloadConfig, dtype: torch.dtype, device: torch.device, mlps: list[Callable],
                 process: dict | None = None) -> None:
        self.path = path
        self._process = process or {}  # the preflight's process terms (interpreter RSS, limit): see preflight
        self.model = model
        self.config = model.config
        self.family, self.layers = family, layers
        self.checkpoint = checkpoint
        self.offload = offload
        self.dtype, self.device = dtype, device
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
            mlps = slot_mlps(layout, [f.act for f in mlps], device)
            self.source = _sidecar(path, checkpoint, layers, layout)
        else:
            self.source = NativeSource(checkpoint)
        low_source = None  # --resident-quant: every expert's low-precision copy, resident (offload/lowtier.py)
        if offload.resident_quant is not None:
            check_resident_quant(offload, acts)
            low_layout = quant_layout_for(checkpoint, layers[0].layer_id, offload.resident_quant, None, dtype, device)
            low_source = _sidecar(path, checkpoint, layers, low_layout)
        precision = offload.precision_rule()
        # every expert present and well-formed before anything runs (loud); where its bytes go in a slot
        io = offload.io if offload.tier == "disk" else "cached"
        self._parts = {(m.index, e): self.source.parts(m.layer_id, e) for m in layers for e in range(self.num_experts)}
        # the captured step's in-graph products read every slot at one layout: disk reads land packed
        self.graph_experts = graph_products(offload, model, next(iter(self._parts.values())), dtype, device)
        self._placement = {k: place_expert(p, io, packed=self.graph_experts) for k, p in self._parts.items()}
        self.expert_bytes, self.slot_bytes, self._io_bytes = expert_sizes(self._parts, self._placement,
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
        # the views of an expert in a slot depend on its layout there: one small id per distinct layout
        self._layout_of = layout_ids(self._parts, self._placement)
        self.grouped = expert_product(offload.expert_product, dtype, device)  # None: 'mv'
        self.eviction = "lru"
        self.gamma = DEFAULT_GAMMA
        self.observers = Observers()
        self.reads = SlotReads(self.tier, self.host, self.readers, self._parts, self._placement, self.slot_bytes,
                               device)
        self.routes = Routes(family, layers, [m.router.forward for m in layers], on_device=not on_host(device),
                             prefetch_ahead=offload.prefetch, cache_of=lambda i: self.steps.states[i].cache,
                             miss_costs=lambda i: self.steps.miss_costs(i))
        self.steps = CacheSteps(arena=None, views=None, reads=self.reads, observers=self.observers, host=self.host,
                                low=self.low, precision=precision, num_experts=self.num_experts,
                                expert_bytes=self.expert_bytes, prefetch_ahead=offload.prefetch, grouped=self.grouped,
                                new_cache=self._new_cache, host_copy=self.routes.host_copy,
                                guess=functools.partial(guess_next_layer, self.routes))
        self.capture = CapturedSeams(layers, self.routes, self.steps, self.observers, [getattr(f, "act", None)
                                                                                      for f in mlps])
        self._make_pools(self.capacity)
        self.configure(routing=RoutingConfig())
        for m in layers:
            m.router.forward = self._make_router_forward(m, self.routes.stock_routers[m.index])
        first = self.model.model.layers[layers[0].layer_id]  # its MoE layer's guess starts before its attention
        first.register_forward_pre_hook(self._guess_first, with_kwargs=True)

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, offload: OffloadConfig = OffloadConfig(), *,
                        dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                        routing: RoutingConfig | None = None, eviction: str = "lru", **configure_kw) -> "OffloadedModel":
        """Build the runtime for a checkpoint folder (or 'granular'/'coarse'). ``dtype`` defaults to the
        checkpoint's; ``device`` to CPU. ``routing``/``eviction``/``configure_kw`` go to :meth:`configure`
        (:func:`_load`: refused before anything is loaded where the memory plan cannot hold the model)."""
        return _load(cls, path, offload, dtype=dtype, device=device, routing=routing, eviction=eviction,
                     **configure_kw)

    def _plan(self) -> MemoryPlan:
        plan = plan_from(self.model, self.offload, self.dtype, self._process, dense_mode=None,
                         expert_bytes=self.expert_bytes, slot_bytes=self.slot_bytes, io_bytes=self._io_bytes,
                         num_layers=len(self.layers), num_experts=self.num_experts, top_k=self.top_k,
                         readers=self.offload.readers, host_bytes=self.host.nbytes if self.host is not None else 0,
                         low_tier_bytes=self._low_bytes, slot_extra=slot_copy_bytes(self.source.quant, self.device))
        if self.host is not None:  # the host level has its own budget (--host-memory), beside the fast tier's
            plan = dataclasses.replace(plan, host_slots=self.host.slots)
        return dataclasses.replace(plan, pinned_bytes=getattr(self.tier, "pinned_bytes", 0))

    def _make_pools(self, capacity: int) -> None:
        """One arena of C cache slots per layer plus one scratch slot and P spares shared by all layers."""
        arena = SlotArena(len(self.layers), capacity, self.slot_bytes, self.device, scratch=1,
                          spare=self.offload.prefetch)
        self.views = SlotViews(arena, self._parts, self._placement, self._layout_of, self.dtype, self.source.quant,
                               copies=self.plan.slot_bytes > self.slot_bytes)  # the plan counts FBGEMM's copies
        self.steps.use_arena(arena, self.views)
        # the captured step's in-graph expert products (or None): where the runtime decided so at construction
        # (graph_experts) and every expert sits at one layout in its slot
        self.capture.inline_views = self.views.inline() if self.graph_experts else None
        # captured decode graphs bake in the arena: a new one needs new graphs
        self.model.__dict__.pop("_expertcache_captured", None)
        self.model.__dict__.pop("_expertcache_captured_warm", None)

    def _new_cache(self) -> ExpertCache:
        """An empty cache of one layer under the configured eviction rule and capacity."""
        return make_cache(self.eviction, self.num_experts, self.capacity, gamma=self.gamma,
                          expert_bytes=self.expert_bytes)

    # -- the parts' state, where callers read it ------------------------------------------------

    @property
    def states(self) -> list[LayerState]:
        """Per MoE layer: its cache, slots and counters (:class:`~expertcache.offload.step.LayerState`)."""
        return self.steps.states

    @property
    def arena(self) -> SlotArena:
        return self.steps.arena

    @property
    def prefetch_stats(self) -> PrefetchStats:
        return self.steps.prefetch_stats

    @property
    def io_wait_seconds(self) -> float:
        """Seconds the compute thread waited for reads (:attr:`SlotReads.io_wait_seconds`)."""
        return self.reads.io_wait_seconds

    @io_wait_seconds.setter
    def io_wait_seconds(self, value: float) -> None:
        self.reads.io_wait_seconds = value

    @property
    def routing(self) -> RoutingConfig:
        """The routing policy's configuration (:attr:`Routes.routing`); set with :attr:`router` to swap the policy
        without emptying the caches (the live view's control), else through :meth:`configure`."""
        return self.routes.routing

    @routing.setter
    def routing(self, value: RoutingConfig) -> None:
        self.routes.routing = value

    @property
    def router(self):
        """The routing policy's :class:`~expertcache.routing.Router` (fresh at each :meth:`configure`)."""
        return self.routes.router

    @router.setter
    def router(self, value) -> None:
        self.routes.router = value

    # -- routing (offload/routes.py) -------------------------------------------------------------

    def route(self, m: MoELayer, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor, *,
              commit: bool = True):
        """:meth:`Routes.route`: (weights [T, K], ids [T, K]) MoE layer ``m`` computes with."""
        return self.routes.route(m, z_TE, w0_TK, ids0_TK, commit=commit)

    def route_policy(self, m: MoELayer, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor, *,
                     commit: bool = True):
        """:meth:`Routes.route_policy`: the routing policy's (weights, ids) against the live residency."""
        return self.routes.route_policy(m, z_TE, w0_TK, ids0_TK, commit=commit)

    def set_row_router(self, fn: Callable | None) -> None:
        """:meth:`Routes.set_row_router`: route through ``fn`` instead of the routing policy (None: the policy)."""
        self.routes.set_row_router(fn)

    def stock_route(self, index: int, x_TD: torch.Tensor):
        """:meth:`Routes.stock_route`: MoE layer ``index``'s own router for ``x_TD`` (no policy, no step)."""
        return self.routes.stock_route(index, x_TD)

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`Routes.host_copy`: ``t`` in host memory (the kept copy of the router call's transfer)."""
        return self.routes.host_copy(t)

    def miss_costs(self, index: int) -> np.ndarray:
        """:meth:`CacheSteps.miss_costs`: each expert's relative load cost at layer ``index`` now."""
        return self.steps.miss_costs(index)

    def read_job(self, index: int, e: int, slot: int) -> Callable[[], int]:
        """The read of expert ``e`` of MoE layer ``index`` into ``slot``, as a reader thread runs it (returns the
        bytes read); not queued and not booked in any cache (the bandwidth probe of ``offload/bench.py``)."""
        return self.reads.job(self.states[index], e, slot, self._placement[(index, e)])

    def prefetch(self, index: int, experts: Iterable[int]) -> int:
        """:meth:`CacheSteps.prefetch`: load ``experts`` of MoE layer ``index`` ahead of use (cache steps counted
        as prefetches); returns the number loaded."""
        return self.steps.prefetch(index, experts)

    # -- observers (offload/observe.py) ---------------------------------------------------------

    def add_step_observer(self, fn: Callable[[StepEvent], None], *, when: Callable[[], bool] | None = None
                          ) -> ObserverHandle:
        """Call ``fn(StepEvent)`` after every cache step (every MoE layer of every forward; prefetch loads)."""
        return self.observers.add("step", fn, when)

    def add_prefetch_observer(self, fn: Callable[[PrefetchEvent], None], *, when: Callable[[], bool] | None = None
                              ) -> ObserverHandle:
        """Call ``fn(PrefetchEvent)`` after each explicit prefetch and each next-layer guess's reads."""
        return self.observers.add("prefetch", fn, when)

    def add_router_observer(self, fn: Callable[[RouterEvent], None], *, when: Callable[[], bool] | None = None
                            ) -> ObserverHandle:
        """Call ``fn(RouterEvent)`` after each forward's routing at each MoE layer."""
        return self.observers.add("router", fn, when)

    # -- the hooks on the model ------------------------------------------------------------------

    def _serve(self, index: int, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """The eager experts seam (:class:`OffloadedExperts` of MoE layer ``index`` calls it): its cache step."""
        return self.steps.serve(index, x_TD, ids_TK, w_TK)

    def _guess_first(self, decoder_layer: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the first MoE layer's decoder layer: with prefetch on, guess that layer's experts
        from the hidden state entering it (:func:`~expertcache.offload.prefetch.first_layer_input`) and start
        their reads before its attention runs."""
        if not self.offload.prefetch:
            return
        h = args[0] if args else kwargs.get("hidden_states")
        if h is None:
            return
        with torch.inference_mode():
            self.steps.guess_next(0, first_layer_input(decoder_layer, h))
        self.steps.report_guesses()

    def _make_router_forward(self, m: MoELayer, stock):
        def forward(hidden_states, *args, **kwargs):
            if self.capture.capturing and torch.compiler.is_compiling():  # traced by the captured step: an operator
                z_TE, w0_TK, ids0_TK = stock(hidden_states, *args, **kwargs)
                w_TK, ids_TK = torch.ops.expertcache.route(hidden_states, z_TE, w0_TK, ids0_TK, m.index)
                return z_TE, w_TK, ids_TK
            x_TD, t = bucket_rows(hidden_states) if hidden_states.dim() == 2 else (hidden_states, None)
            z_TE, w0_TK, ids0_TK = stock(x_TD, *args, **kwargs)
            if x_TD is not hidden_states:  # rows padded to a bucket as every linear's (offload/experts.py); per token
                z_TE, w0_TK, ids0_TK = z_TE[:t], w0_TK[:t], ids0_TK[:t]
            if self.routes.on_device:
                self.routes.fetch_host(m, x_TD, t if x_TD is not hidden_states else None, z_TE, w0_TK, ids0_TK)
            w_TK, ids_TK = self.routes.route(m, z_TE, w0_TK, ids0_TK)
            if self.observers.router:
                self.observers.notify_router(m.index, z_TE, ids_TK, w_TK)
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
            self.steps.precision = precision
        self.steps.drain()
        if capacity is not None and capacity != self.capacity:
            if not 1 <= capacity <= self.num_experts:
                raise ValueError(f"cache size must be between 1 and N={self.num_experts}, got {capacity}")
            self.capacity = capacity
            self._make_pools(capacity)
        eviction = eviction or self.eviction
        if eviction_rule(eviction).offline:
            raise ValueError(f"{eviction} needs the future requests; a live run cannot use it (replay a trace instead)")
        self.eviction = eviction
        self.steps.record = self.steps.record if record is None else record
        old = self.routes.router
        freq = (getattr(old, "freq_LE", None) if freq_LE is None
                else torch.as_tensor(np.asarray(freq_LE), dtype=torch.float32))
        self.routes.configure(routing or self.routes.routing, freq)
        self.gamma = gamma
        self.arena.reset()
        self.steps.reset([LayerState(m, self._mlps[m.index], self._new_cache(), self.arena.pools[m.index])
                          for m in self.layers])
        self.tier.stats = TierStats()
        if self.host is not None:
            self.host.reset()
        self.reads.reset_stats()

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
        self.reads.reset_stats()
        self.steps.prefetch_stats = PrefetchStats()

    def close(self) -> None:
        """Wait for reads in flight and stop the reader threads."""
        self.steps.drain()
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
        ``length`` positions or more, the token's whole step one compiled graph; its operators call
        :class:`~expertcache.offload.capture.CapturedSeams`)
        for a generation of ``rows`` rows, or None where :meth:`generate` decodes eagerly: ``compile`` off, more
        than one row, or a model of a layout it does not take (``captured_unsupported`` in :meth:`describe`)."""
        if not self.offload.compile or rows != 1 or unsupported_reason(self.model) is not None:
            return None
        guess = (self.layers[0].layer_id, self._guess_first_captured) if self.offload.prefetch else None
        return CapturedDecode(self.model, length, guess, owner=self.capture)

    def graph_products(self, index: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Callable] | None:
        """:meth:`CapturedSeams.graph_products`: the views and activation of layer ``index``'s in-graph product."""
        return self.capture.graph_products(index)

    @property
    def capturing(self) -> bool:
        """True while a captured decode step runs (:attr:`CapturedSeams.capturing`)."""
        return self.capture.capturing

    def _guess_first_captured(self, decoder_layer: nn.Module, h_11D: torch.Tensor) -> None:
        self._guess_first(decoder_layer, (h_11D,), {})

    @torch.inference_mode()
    def generate(self, input_ids_BS: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                 on_token: Callable[[torch.Tensor], None] | None = None, stop: int | None = None,
                 forced_BN: torch.Tensor | None = None, on_compile: Callable[[], None] | None = None) -> dict:
        """Greedy (``temperature=0``) or sampled decoding: :func:`~expertcache.offload.generate.generate` (its
        returns: ``tokens`` [B, n], ``prefill_s``, ``decode_s``, ``decode_tokens``, ``decode_stats``,
        ``compile_s``). With ``compile`` on, a one-row generation decodes through :meth:`captured`, and
        ``on_compile()`` is called just before its graph's compilation starts."""

        def start():
            captured = self.captured(input_ids_BS.shape[0], input_ids_BS.shape[1] + max_new_tokens)
            if captured is not None:
                return captured.prefill(input_ids_BS, on_compile), captured.step, lambda: captured.compile_s
            logits_BV, past = self.prefill(input_ids_BS)
            kv = [past]

            def step(tok_B1: torch.Tensor) -> torch.Tensor:
                logits_BV, kv[0] = self.decode_one_token(tok_B1, kv[0])
                return logits_BV
            return logits_BV, step, lambda: 0.0

        return generate(start, max_new_tokens, stats=self.stats, rows=input_ids_BS.shape[0], source=self.path,
                        temperature=temperature, seed=seed, on_token=on_token, stop=stop, forced_BN=forced_BN)

    # -- results ---------------------------------------------------------------------------------

    def cache_stats(self) -> list[CacheStats]:
        return [st.cache.finish() for st in self.states]

    def stats(self) -> dict:
        """:func:`~expertcache.offload.stats.runtime_stats`: hits, misses, bytes read, waits, compute time,
        prefetch counters. Waits for reads in flight first, so counts are final."""
        return runtime_stats(self.steps, self.reads, self.tier, self.host)

    def recorded_ids_TLK(self) -> np.ndarray:
        """[T, L, K] ids of the recorded single-token steps (``configure(record=True)``), for
        :func:`expertcache.sim.replay` (:func:`~expertcache.offload.stats.recorded_ids`)."""
        return recorded_ids(self.states, self.top_k)

    def describe(self) -> dict:
        """Resolved configuration (JSON-serialisable) for result rows."""
        return dict(version=__version__, model=str(self.path), model_type=self.family.model_type,
                    num_experts=self.num_experts, top_k=self.top_k, moe_layers=len(self.layers),
                    dtype=str(self.dtype).replace("torch.", ""), device=str(self.device), tier=self.offload.tier,
                    host_slots=self.host.slots if self.host is not None else 0,
                    io=self.offload.io if self.offload.tier == "disk" else None, quant=self.offload.quant,
                    quant_dense=self.offload.quant_dense, resident_quant=self.offload.resident_quant,
                    precision=self.steps.precision.to_dict() if self.low is not None else None,
                    group=self.offload.group if self.offload.quant else None, capacity=self.capacity,
                    quant_kernel=padding_note(self.source.quant) if self.source.quant is not None else None,
                    dense_kernel=dense_kernel_note(self.model), dense_load=getattr(self, "dense_load", {}),
                    quant_opt=self.offload.quant_opt, cpu=cpu_description(),
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
        return "graph" if self.capture.inline_views is not None else "eager"

    def _captured_unsupported(self) -> str | None:
        """Why ``compile`` does not take the captured decode step for this model (None: it does, or compile is off)."""
        return unsupported_reason(self.model) if self.offload.compile else None

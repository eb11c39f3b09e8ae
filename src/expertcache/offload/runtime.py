"""The offloaded MoE runtime: a transformers model whose experts live on a slow tier and are served from a
fixed number of fast-tier slots per layer.

Letter legend: B batch rows, S new tokens per row, T = B·S tokens of one forward call, E experts (N), K
experts per token, D hidden, F expert intermediate size, U experts requested by one step (the union), C
slots per layer.

Construction (:meth:`OffloadedModel.from_pretrained`) never loads the experts: the model skeleton is built
on the meta device, each MoE block's ``experts`` module is replaced by an :class:`OffloadedExperts` (no
weights), only the non-expert tensors are materialised and read from the checkpoint by key (every one of
them must be found: loud), and rotary tables are recomputed.

One forward call at one MoE layer is one **step** of that layer's cache:

1. the router (the model's own, wrapped) computes logits; the routing policy ranks them against the
   *live* residency mask of this layer (all T tokens see the residency at the start of the step) and the
   family's weight rule weights the selection (``original`` returns the stock router's output untouched);
2. the step requests the union U of the selected experts, ordered by total router weight (descending; for
   one token: the token's own order), and ``cache.access_step(U)`` decides hits, misses and evictions;
3. hits are computed from their slots first; then each miss is read from the tier into the slot freed by
   an evicted expert (or a scratch slot if the cache itself does not keep it, only possible when U > C)
   and computed right away;
4. per-expert outputs are combined in ascending expert id, as transformers' eager experts loop does.

Contracts (pinned by tests): with ``original`` routing the logits equal the in-memory model's at every
capacity 1..N; for decoding (one token per step) the live hit/miss counts equal
:func:`expertcache.sim.replay` of :meth:`OffloadedModel.recorded_ids_TLK`; a damaged checkpoint or a missing
expert key raises :class:`~expertcache.offload.checkpoint.CheckpointError`.

GPU: with ``device='cuda'`` slots are CUDA memory, misses are read into a pinned staging buffer and copied
on a side stream (compute waits on an event). That path is written but untested here (no GPU).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from expertcache import __version__
from expertcache.cache import CacheStats, ExpertCache, make_cache
from expertcache.models.adapters import Family, MoELayer, family_for, find_moe_layers, order_by_logits
from expertcache.offload.budget import MemoryPlan, kv_cache_bytes, parse_bytes, plan_memory
from expertcache.offload.checkpoint import OFFLOAD_MODEL_TYPES, Checkpoint, CheckpointError, ExpertParts
from expertcache.models.loader import check_weights_match_config
from expertcache.offload.quant import QuantLayout, default_group, unpack_expert
from expertcache.offload.store import (TIERS, DiskTier, HostTier, NativeSource, QuantSource, TierStats,
                                       quant_sidecar_path, quantize_checkpoint)
from expertcache.routing import Router, RoutingConfig

__all__ = ["OffloadedModel", "OffloadedExperts", "OffloadConfig", "resolve_model_path"]


def resolve_model_path(name: str | os.PathLike) -> Path:
    """``'granular'``/``'coarse'`` → the shipped model folder; a hub name ``owner/name`` that is not a local
    path → its local copy (downloaded if needed, :func:`expertcache.models.loader.fetch_hub_model`); anything
    else is a checkpoint folder."""
    from expertcache.assets import SHIPPED_MODELS, shipped_model_dir
    from expertcache.models.loader import fetch_hub_model, is_hub_name

    if str(name) in SHIPPED_MODELS:
        return shipped_model_dir(str(name))
    if is_hub_name(name):
        return fetch_hub_model(str(name))
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist (give a checkpoint folder, 'granular', "
                                "'coarse' or a hub name owner/name)")
    return path


@dataclass(frozen=True)
class OffloadConfig:
    """Where experts live and how many fit.

    tier: 'disk' (read the checkpoint on every miss) or 'host' (all experts in host RAM). io: disk reads,
    'direct' | 'fadvise' | 'cached' (see :mod:`expertcache.offload.store`). capacity: slots per layer C, or
    None to derive it from ``memory`` (bytes or '3GiB'); both None = every expert (C = N). quant: None,
    'int8' or 'int4' (group ``group``; None = the largest divisor of D and F up to 64, see
    :func:`~expertcache.offload.quant.default_group`). context, batch: the KV cache the budget reserves.
    """

    tier: str = "disk"
    io: str = "direct"
    capacity: int | None = None
    memory: int | str | None = None
    quant: str | None = None
    group: int | None = None
    context: int = 2048
    batch: int = 1


# ---------------------------------------------------------------------------------------------
# fast tier


class SlotPool:
    """C + 1 preallocated expert slots of one layer (the last one is scratch for experts the cache does not
    keep), each ``slot_bytes`` bytes, one contiguous [C + 1, slot_bytes] uint8 tensor on ``device``."""

    def __init__(self, slots: int, slot_bytes: int, device: torch.device) -> None:
        self.capacity = slots
        self.buffer = torch.empty(slots + 1, slot_bytes, dtype=torch.uint8, device=device)
        self.scratch = slots
        self.slot_of: dict[int, int] = {}
        self.free: list[int] = list(range(slots - 1, -1, -1))

    def reset(self) -> None:
        self.slot_of.clear()
        self.free = list(range(self.capacity - 1, -1, -1))


@dataclass
class LayerState:
    """Runtime state of one MoE layer."""

    moe: MoELayer
    act_fn: Callable
    cache: ExpertCache
    pool: SlotPool
    steps: list[list[int]] = field(default_factory=list)  # recorded union ids of single-token steps
    prefetched: int = 0


class OffloadedExperts(nn.Module):
    """Drop-in for a transformers experts module: ``forward(hidden_TD, ids_TK, weights_TK)``, weights
    served by the runtime. Holds no parameters."""

    def __init__(self, runtime: "OffloadedModel", index: int) -> None:
        super().__init__()
        self._runtime = [runtime]  # a list: not registered as a submodule
        self.index = index

    def forward(self, hidden_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self._runtime[0]._serve(self.index, hidden_TD, ids_TK, weights_TK)


# ---------------------------------------------------------------------------------------------
# runtime


class OffloadedModel:
    """A causal LM with offloaded experts; see the module docstring. Build with :meth:`from_pretrained`."""

    def __init__(self, path: Path, model: nn.Module, family: Family, layers: list[MoELayer], checkpoint: Checkpoint,
                 offload: OffloadConfig, dtype: torch.dtype, device: torch.device, act_fns: list[Callable]) -> None:
        self.path = path
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
        if offload.quant:
            p0 = checkpoint.expert(layers[0].layer_id, 0)
            if offload.group is None:  # the largest group ≤ 64 that divides D and F (every shipped model)
                offload = self.offload = dataclasses.replace(offload, group=default_group(p0.d, p0.f))
            layout = QuantLayout(offload.quant, p0.d, p0.f, offload.group)
            side = quant_sidecar_path(path, offload.quant, offload.group)
            if not side.is_file():  # never write into the model folder: a cache keyed by the checkpoint
                import hashlib

                stamp = "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                                 for p in sorted({t.file for t in checkpoint.entries.values()}))
                key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
                side = quantize_checkpoint(checkpoint, [m.layer_id for m in layers], offload.quant, offload.group,
                                           out=_cache_dir() / "quant" / f"{path.name}-{key}-{side.name}")
            self.source = QuantSource(side, layout, self.num_experts)
        else:
            self.source = NativeSource(checkpoint)
        for m in layers:  # every expert present and well-formed before anything runs (loud)
            for e in range(self.num_experts):
                self.source.parts(m.layer_id, e)
        self.expert_bytes = self.source.parts(layers[0].layer_id, 0).nbytes
        self.tier = DiskTier(offload.io) if offload.tier == "disk" else \
            HostTier(self.source, [m.layer_id for m in layers], self.num_experts)
        self.plan = self._plan()
        self.capacity = self.plan.slots
        self._act_fns = act_fns
        self._cuda = device.type == "cuda"
        if self._cuda:  # pragma: no cover - GPU only
            self._stream = torch.cuda.Stream(device)
            self._staging = torch.empty(self.expert_bytes, dtype=torch.uint8, pin_memory=True)
            self._staging_event: torch.cuda.Event | None = None
        self.pools = [SlotPool(self.capacity, self.expert_bytes, device) for _ in layers]
        self.routing = RoutingConfig()
        self.eviction = "lru"
        self.record = False
        self.configure()
        self._install_routers()

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, offload: OffloadConfig = OffloadConfig(), *,
                        dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                        routing: RoutingConfig | None = None, eviction: str = "lru", **configure_kw) -> "OffloadedModel":
        """Build the runtime for a checkpoint folder (or 'granular'/'coarse'). ``dtype`` defaults to the
        checkpoint's; ``device`` to CPU. ``routing``/``eviction``/``configure_kw`` go to :meth:`configure`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        path = resolve_model_path(path)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        family = family_for(config)
        if family.model_type not in OFFLOAD_MODEL_TYPES:
            raise ValueError(f"offloading supports model types {', '.join(OFFLOAD_MODEL_TYPES)}; {path} is "
                             f"{family.model_type!r}")
        if offload.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {offload.tier!r}")
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        device = torch.device(device or "cpu")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        check_weights_match_config(path, config, model)  # config.json vs the safetensors shapes, named
        layers = find_moe_layers(model, family)
        num_experts = layers[0].num_experts
        checkpoint = Checkpoint(path, family.model_type, num_experts)
        act_fns = []
        holder: list = []
        for m in layers:
            act_fns.append(m.block.experts.act_fn)
            m.block.experts = OffloadedExperts(holder, m.index)  # runtime bound below
        model.to_empty(device=device)
        _load_non_expert(model, checkpoint, family.model_type, config)
        _recompute_rotary(model, config, device)
        runtime = cls(path, model, family, layers, checkpoint, offload, dtype, device, act_fns)
        for m in layers:
            m.block.experts._runtime = [runtime]
        runtime.configure(routing=routing or RoutingConfig(), eviction=eviction, **configure_kw)
        return runtime

    def _plan(self) -> MemoryPlan:
        o = self.offload
        seen, non_expert = set(), 0
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                non_expert += t.numel() * t.element_size()
        kv = kv_cache_bytes(self.config, o.context, o.batch, torch.empty((), dtype=self.dtype).element_size())
        budget = None if o.memory is None else parse_bytes(o.memory)
        slots = o.capacity if budget is not None or o.capacity is not None else self.num_experts
        if budget is not None and o.capacity is not None:
            raise ValueError("give either --memory or --cache-experts, not both")
        return plan_memory(budget=budget, slots=None if budget is not None else slots, non_expert_bytes=non_expert,
                           kv_bytes=kv, expert_bytes=self.expert_bytes, num_layers=len(self.layers),
                           num_experts=self.num_experts, top_k=self.top_k)

    def _install_routers(self) -> None:
        for m in self.layers:
            stock = m.router.forward
            m.router.forward = self._make_router_forward(m, stock)

    def _make_router_forward(self, m: MoELayer, stock):
        def forward(hidden_states, *args, **kwargs):
            z_TE, w0_TK, ids0_TK = stock(hidden_states, *args, **kwargs)
            if self.routing.policy == "original":
                return z_TE, w0_TK, ids0_TK
            z_cpu_TE = z_TE.detach().to("cpu")
            zr_TE, allowed_TE = self.family.ranking(m.router, z_cpu_TE)
            if self.routing.cache_aware:
                resident_TE = torch.tensor(self.states[m.index].cache.resident_mask()).expand_as(zr_TE)
            else:
                resident_TE = torch.ones_like(zr_TE, dtype=torch.bool)
            if allowed_TE is not None:
                resident_TE = resident_TE & allowed_TE
            ids_TK = order_by_logits(self.router.rank(m.index, zr_TE, resident_TE), z_cpu_TE)
            w_TK = self.family.weights(m.router, z_cpu_TE, ids_TK)
            return z_TE, w_TK.to(w0_TK.dtype).to(w0_TK.device), ids_TK.to(ids0_TK.device)

        return forward

    # -- configuration ---------------------------------------------------------------------------

    def configure(self, *, routing: RoutingConfig | None = None, eviction: str | None = None, gamma: float = 0.9,
                  freq_LE: np.ndarray | torch.Tensor | None = None, record: bool | None = None,
                  capacity: int | None = None) -> None:
        """(Re)start with a routing policy and fresh, empty caches (slots emptied, statistics zeroed).
        ``capacity`` re-sizes the fast tier to that many slots per layer (bypasses the memory plan)."""
        if capacity is not None and capacity != self.capacity:
            if not 1 <= capacity <= self.num_experts:
                raise ValueError(f"cache size must be between 1 and N={self.num_experts}, got {capacity}")
            self.capacity = capacity
            self.pools = [SlotPool(capacity, self.expert_bytes, self.device) for _ in self.layers]
        self.routing = routing or self.routing
        self.eviction = eviction or self.eviction
        if self.eviction == "belady":
            raise ValueError("belady needs the future requests; a live run cannot use it (replay a trace instead)")
        self.record = self.record if record is None else record
        freq = None if freq_LE is None else torch.as_tensor(np.asarray(freq_LE), dtype=torch.float32)
        self.router = Router(self.routing, num_experts=self.num_experts, k=self.top_k, renormalize=self.renormalize,
                             scoring=self.family.scoring, freq_LE=freq)
        self.gamma = gamma
        for pool in self.pools:
            pool.reset()
        self.states = [LayerState(m, self._act_fns[m.index],
                                  make_cache(self.eviction, self.num_experts, self.capacity, gamma=gamma,
                                             expert_bytes=self.expert_bytes), self.pools[m.index])
                       for m in self.layers]
        self.tier.stats = TierStats()
        self.compute_seconds = 0.0

    def warm(self, experts: Iterable[int] | None = None) -> None:
        """Load ``experts`` (default: the first C ids) into every layer, then zero all statistics."""
        ids = list(range(self.capacity)) if experts is None else list(experts)
        for li in range(len(self.layers)):
            self.prefetch(li, ids[: self.capacity])
        for st in self.states:
            st.cache.stats = CacheStats(self.num_experts)
            st.prefetched = 0
        self.tier.stats = TierStats()

    # -- the MoE step ----------------------------------------------------------------------------

    def _load(self, st: LayerState, e: int, slot: int) -> None:
        parts = self.source.parts(st.moe.layer_id, e)
        dest = st.pool.buffer[slot]
        if not self._cuda:
            if isinstance(self.tier, HostTier):
                self.tier.fetch(st.moe.layer_id, e, dest)
            else:
                self.tier.fetch(parts, dest)
            return
        # pragma: no cover - GPU only: tier -> pinned staging -> slot on the side stream
        if self._staging_event is not None:  # the previous copy out of the staging buffer is done
            self._staging_event.synchronize()
        if isinstance(self.tier, HostTier):
            src = self.tier.fetch_row(st.moe.layer_id, e)
            self.tier.stats.loads += 1
            self.tier.stats.bytes_read += src.numel()
        else:
            self.tier.fetch(parts, self._staging)
            src = self._staging
        with torch.cuda.stream(self._stream):
            dest[:src.numel()].copy_(src, non_blocking=True)
            self._staging_event = torch.cuda.Event()
            self._staging_event.record(self._stream)
        torch.cuda.current_stream(self.device).wait_event(self._staging_event)

    def _weights(self, st: LayerState, e: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2F, D], down [D, F]) of expert ``e`` in ``slot``, in the compute dtype."""
        blob = st.pool.buffer[slot]
        parts: ExpertParts = self.source.parts(st.moe.layer_id, e)
        if self.source.quant is not None:
            return unpack_expert(blob[:parts.nbytes], self.source.quant, self.dtype)
        w = blob[:parts.nbytes].view(parts.dtype)
        fd = parts.f * parts.d
        gu = w[parts.gate_up_at:parts.gate_up_at + 2 * fd].view(2 * parts.f, parts.d)
        down = w[parts.down_at:parts.down_at + fd].view(parts.d, parts.f)
        return gu.to(self.dtype), down.to(self.dtype)

    def _step(self, st: LayerState, order: Sequence[int], on_ready: Callable[[int, int], None] | None) -> None:
        """Serve one cache step for the requested ids ``order`` (descending weight): bookkeeping first, then
        hits (``on_ready(e, slot)``), then each miss loaded and handed to ``on_ready``."""
        pool = st.pool
        before = dict(pool.slot_of)
        hits = st.cache.access_step(list(order))
        after = st.cache.resident()
        if on_ready is not None:
            for e, hit in zip(order, hits):
                if hit:
                    on_ready(e, before[e])
        for e in before:
            if e not in after:
                pool.free.append(pool.slot_of.pop(e))
        for e, hit in zip(order, hits):
            if hit:
                continue
            if e in after:
                slot = pool.free.pop()
                pool.slot_of[e] = slot
            else:
                slot = pool.scratch
            self._load(st, e, slot)
            if on_ready is not None:
                on_ready(e, slot)
        assert set(pool.slot_of) == set(after), (sorted(pool.slot_of), sorted(after))

    def _serve(self, index: int, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        st = self.states[index]
        ids_cpu_TK = ids_TK.to("cpu")
        if ids_cpu_TK.shape[0] == 1:
            order = [e for e in ids_cpu_TK[0].tolist() if e >= 0]
        else:  # union, by total weight (descending; ties by id)
            valid_TK = ids_cpu_TK >= 0
            total_E = torch.zeros(self.num_experts, dtype=torch.float32).index_add_(
                0, ids_cpu_TK[valid_TK], w_TK.to("cpu").float()[valid_TK])
            used_E = torch.zeros(self.num_experts, dtype=torch.bool)
            used_E[ids_cpu_TK[valid_TK]] = True
            cand = torch.nonzero(used_E).flatten().tolist()
            order = sorted(cand, key=lambda e: (-float(total_E[e]), e))
        if self.record and ids_cpu_TK.shape[0] == 1:
            st.steps.append(list(order))
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        t0 = time.perf_counter()
        io0 = self.tier.stats.seconds

        def compute(e: int, slot: int) -> None:
            k_pos, tok = torch.where((ids_TK == e).T)  # transformers' order: by slot k, then token
            gu, down = self._weights(st, e, slot)
            gate, up = F.linear(x_TD[tok], gu).chunk(2, dim=-1)
            h = F.linear(st.act_fn(gate) * up, down)
            out[e] = (tok, h * w_TK[tok, k_pos, None])

        self._step(st, order, compute)
        final_TD = torch.zeros_like(x_TD)
        for e in sorted(out):
            tok, h = out[e]
            final_TD.index_add_(0, tok, h.to(final_TD.dtype))
        self.compute_seconds += time.perf_counter() - t0 - (self.tier.stats.seconds - io0)
        return final_TD

    def prefetch(self, index: int, experts: Iterable[int]) -> int:
        """Load ``experts`` of MoE layer ``index`` ahead of use (e.g. from a predictor). Each load is a cache
        step (eviction by the cache policy) counted as a prefetch, not as a demand hit or miss. At most C of
        them; already resident ones are skipped. Returns the number loaded."""
        st = self.states[index]
        ids = [int(e) for e in dict.fromkeys(experts) if int(e) not in st.cache][: self.capacity]
        if not ids:
            return 0
        s = st.cache.stats
        saved = (s.accesses, s.hits, s.misses, s.steps, s.bytes_loaded)
        self._step(st, ids, None)
        s.accesses, s.hits, s.misses, s.steps, s.bytes_loaded = saved
        st.prefetched += len(ids)
        return len(ids)

    # -- generation ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids_BS: torch.Tensor, past=None, attention_mask=None):
        """One model forward (prefill or decode); returns the transformers output (logits, past_key_values)."""
        return self.model(input_ids=input_ids_BS.to(self.device), past_key_values=past, use_cache=True,
                          attention_mask=attention_mask)

    def prefill(self, input_ids_BS: torch.Tensor):
        """(logits of the last position [B, V], KV cache) of the prompt."""
        from transformers import DynamicCache

        out = self.forward(input_ids_BS, DynamicCache(config=self.config))
        return out.logits[:, -1], out.past_key_values

    def decode_one_token(self, tok_B1: torch.Tensor, past):
        out = self.forward(tok_B1, past)
        return out.logits[:, -1], out.past_key_values

    @torch.inference_mode()
    def generate(self, input_ids_BS: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                 on_token: Callable[[torch.Tensor], None] | None = None, stop: int | None = None,
                 forced_BN: torch.Tensor | None = None) -> dict:
        """Greedy (``temperature=0``) or sampled decoding. Returns ``tokens`` [B, n], ``prefill_s``,
        ``decode_s`` (time of the decode steps only), ``decode_tokens`` (forward calls after the prefill) and
        ``decode_stats`` (hits, misses, bytes read ... of those calls only). ``on_token`` sees each new
        [B, 1] token as soon as it is chosen. ``forced_BN`` feeds those tokens instead of choosing (the
        benchmark's teacher-forced mode: a random-weight model decoded greedily repeats one token)."""
        g = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        logits_BV, past = self.prefill(input_ids_BS)
        t1 = time.perf_counter()
        s0 = self.stats()
        toks = []
        decode_s = 0.0
        for i in range(max_new_tokens):
            if not bool(torch.isfinite(logits_BV).all()):
                raise ValueError(f"non-finite logits (NaN/inf) at decode step {i}: the weights or activations of "
                                 f"{self.path} are not finite")
            if forced_BN is not None:  # teacher-forced continuation (benchmarks: same tokens for every policy)
                nxt_B1 = forced_BN[:, i:i + 1]
            elif temperature > 0:
                probs = torch.softmax(logits_BV.float().cpu() / temperature, dim=-1)
                nxt_B1 = torch.multinomial(probs, 1, generator=g)
            else:
                nxt_B1 = logits_BV.float().cpu().argmax(dim=-1, keepdim=True)
            toks.append(nxt_B1)
            if on_token is not None:
                on_token(nxt_B1)
            if (stop is not None and bool((nxt_B1 == stop).all())) or i == max_new_tokens - 1:
                break
            t = time.perf_counter()
            logits_BV, past = self.decode_one_token(nxt_B1, past)
            decode_s += time.perf_counter() - t
        tokens = torch.cat(toks, dim=1) if toks else torch.zeros(input_ids_BS.shape[0], 0, dtype=torch.long)
        s1 = self.stats()
        d = {k: s1[k] - s0[k] for k in ("accesses", "hits", "misses", "bytes_read", "expert_loads", "io_seconds",
                                         "compute_seconds")}
        d["hit_rate"] = d["hits"] / d["accesses"] if d["accesses"] else 0.0
        return dict(tokens=tokens, prefill_s=t1 - t0, decode_s=decode_s, decode_tokens=max(0, len(toks) - 1),
                    decode_stats=d)

    # -- results ---------------------------------------------------------------------------------

    def cache_stats(self) -> list[CacheStats]:
        return [st.cache.finish() for st in self.states]

    def stats(self) -> dict:
        """Hits, misses, hit rate, bytes read from the tier, load and compute seconds, prefetches."""
        per = self.cache_stats()
        total = per[0]
        for s in per[1:]:
            total = total.merge(s)
        return dict(accesses=total.accesses, hits=total.hits, misses=total.misses, hit_rate=total.hit_rate,
                    evictions=total.evictions, bytes_read=self.tier.stats.bytes_read,
                    expert_loads=self.tier.stats.loads, io_seconds=self.tier.stats.seconds,
                    compute_seconds=self.compute_seconds, prefetched=sum(st.prefetched for st in self.states),
                    per_layer_misses=[s.misses for s in per])

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
                    io=self.offload.io if self.offload.tier == "disk" else None, quant=self.offload.quant,
                    group=self.offload.group if self.offload.quant else None, capacity=self.capacity,
                    expert_bytes=self.expert_bytes, memory=self.plan.to_dict(), routing=self.routing.to_dict(),
                    eviction=self.eviction, gamma=self.gamma if self.eviction == "gamma" else None)


# ---------------------------------------------------------------------------------------------
# loading the non-expert weights


def _cache_dir() -> Path:
    return Path(os.environ.get("EXPERTCACHE_CACHE", Path.home() / ".cache" / "expertcache"))


def _disk_key_candidates(name: str, model_type: str) -> list[str]:
    keys = [name]
    if model_type == "mixtral" and ".mlp." in name:
        keys.append(name.replace(".mlp.", ".block_sparse_moe."))
    return keys


def _load_non_expert(model: nn.Module, ckpt: Checkpoint, model_type: str, config) -> None:
    """Read every non-expert parameter and persistent buffer of ``model`` from the checkpoint by key
    (tied weights once). Missing keys, shape mismatches and unexpected non-expert keys raise."""
    used: set[str] = set()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict(keep_vars=True)
    missing = []
    with torch.no_grad():
        for name, t in state.items():
            key = next((k for k in _disk_key_candidates(name, model_type) if k in ckpt.entries), None)
            if key is None:
                if tied and name == "lm_head.weight":
                    continue
                missing.append(name)
                continue
            src = ckpt.tensor(key)
            if tuple(src.shape) != tuple(t.shape):
                raise CheckpointError(f"{ckpt.folder}: {key} has shape {list(src.shape)}, the model expects "
                                      f"{list(t.shape)}")
            t.copy_(src)
            used.add(key)
    if missing:
        raise CheckpointError(f"{ckpt.folder}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    extra = [k for k in ckpt.entries if k not in used and not ckpt.is_expert_key(k)]
    if extra:
        raise CheckpointError(f"{ckpt.folder}: unexpected tensors {extra[:5]} (unsupported layout?)")


def _recompute_rotary(model: nn.Module, config, device: torch.device) -> None:
    """Non-persistent buffers are not in the checkpoint: rebuild rotary-embedding modules (the only ones the
    supported families have; anything else raises)."""
    for name, mod in list(model.named_modules()):
        if not mod._non_persistent_buffers_set:
            continue
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            raise RuntimeError(f"{name} ({type(mod).__name__}) has non-persistent buffers "
                               f"{sorted(mod._non_persistent_buffers_set)} that the offloaded loader cannot rebuild")
        with torch.device(device):
            fresh = type(mod)(config=config)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)

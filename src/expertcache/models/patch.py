"""Cache-aware routing inside a loaded Hugging Face MoE model: :func:`patch_model` and :class:`MoEPatch`.

Letter legend: B batch rows, S new tokens per row in one forward call, T = B·S, E experts, K per token,
L MoE layers.

Example::

    model = load_model("allenai/OLMoE-1B-7B-0924")
    rc = RoutingConfig(policy="cache-prior", lam=0.5, top_j=2)
    with patch_model(model, rc, capacity=0.5, record=True) as patch:
        for input_ids in sequences:          # [1, S] each
            model(input_ids)
            patch.new_sequence()
        row = patch.stats().to_row()         # miss rate, lifetimes, per layer, resolved config
        patch.trace().save("olmoe.safetensors")

How it works. Each MoE layer's router instance gets its ``forward`` replaced (no weights are copied or
moved). The replacement calls the model's own router forward, then, for every row and every token of the
forward call in time order:

1. ``mask`` = that row's cache residency at this layer (all True without a cache);
2. ``Router.rank`` selects K ids (the routing policy), ordered by descending router weight;
3. ``cache.access_step(ids)`` serves the token (hits/misses, eviction) -- the next token sees the result.

The combine weights of the selected ids come from the family's own weight rule
(:mod:`expertcache.models.adapters`), and the expert compute stays batched (the model's experts module
runs unchanged on the returned ``(ids, weights)``).

What runs, and when (each decision is made by one kernel: the policy's keys and selection in
:mod:`expertcache.routing.kernels`, the eviction in the cache's module; ``tests/test_keyed_select.py``
pins them against the token-by-token oracles of ``tests/oracles.py``):

- **Residency-independent calls** (``policy='original'``, or a prefill outside ``scope='generation'``, with
  nothing recorded) return the stock outputs at once and only queue their selections; the queue is served
  in bulk (one kernel call per layer, :meth:`ExpertCache.serve_array`) before anything reads or serves a
  cache: ``stats()``, ``caches``, ``row_caches``, ``new_sequence()``, ``reset_caches()`` and the next
  cache-aware call (or after 4096 queued tokens per row and layer).
- **Cache-aware policies** run steps 1-3 for all P tokens of a row in one kernel call
  (:mod:`expertcache.models.fused`); the weights of a changed selection come from the family's torch rule.
- A decoding step whose policy kept the model's own choice (same ids as the stock router) returns the stock
  weights unchanged.

Contracts:

- ``policy='original'`` returns exactly the stock router's outputs (bit-identical logits); any cache is
  only observed. A cache-aware policy with strength 0 selects the same ids, weighted by the family's
  formula (equal to the stock weights up to float rounding).
- **Batch > 1**: every row of the batch has its own cache per layer (row b of every forward call is one
  sequence; B comes from the model's ``input_ids``/``inputs_embeds``); caches of rows ≥ 1 are created on
  first use. Padding tokens (``attention_mask == 0`` in the
  mask given to the model's forward, last S columns) keep the original routing, do not touch the cache
  and are not recorded. A 4-D or missing attention mask means every token is real.
- **Scope**: ``scope='all'`` applies the policy to every token. ``scope='generation'`` applies it only in
  forward calls with exactly one new token per row (decoding steps); a call with more than one new token
  (prefill, or a teacher-forced evaluation pass) uses the original routing, but the caches are still
  updated with its selections, and Cache-Prior's running Δavg still sees its logits. (A one-token prompt
  therefore counts as a decoding step.)
- **Sequences**: caches persist across forward calls. :meth:`MoEPatch.new_sequence` marks the end of the
  current sequence(s): ``between_sequences='reset'`` replaces every cache by a fresh one (statistics are
  kept), ``'carry'`` keeps them. Policy state (Δavg) always carries over.
- Hits and misses are counted once per (token, layer, expert); ``stats()`` equals
  :func:`expertcache.sim.replay` of ``trace().ids_TLK`` under the same eviction and capacity (batch 1).
- **Sensitivity perturbation** (001 Sec. 2.3, Fig. 2): ``replace_rank=r`` (1-based, with
  ``policy='original'`` only) replaces the expert at weight rank r of every routed token by an expert drawn
  uniformly from the E − K experts outside the model's top-K (a ``torch.Generator`` seeded with ``seed``,
  so runs are reproducible); the selection is then re-ordered by logit and weighted by the family's rule,
  like any policy's. It obeys ``scope`` and feeds the caches like a policy.
- Patched routers are for inference: a router in training mode raises, and the weights of tokens routed
  by a non-original policy are computed from detached logits (no gradient through the routing).
- Routing runs on the CPU (logits are copied per layer); the expert compute stays on the model's device.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from expertcache import __version__
from expertcache.device import on_host, to_device, to_host, to_host_many
from expertcache.cache import DEFAULT_GAMMA, ExpertCache, eviction_rule, make_cache, resolve_capacity
from expertcache.models import fused
from expertcache.models.recording import Recording
from expertcache.models.streams import CacheStreams
from expertcache.models.adapters import Family, MoELayer, family_for, find_moe_layers, order_by_logits, ranks_logits
from expertcache.routing import Router, RoutingConfig
from expertcache.routing.config import CACHE_PRIOR
from expertcache.sim import SimResult
from expertcache.trace import RoutingTrace, TraceMeta

__all__ = ["patch_model", "MoEPatch", "SCOPES", "BETWEEN_SEQUENCES"]

SCOPES = ("all", "generation")
_SAME_SET_CHECK = 8  # calls of up to this many tokens (decoding) skip the weights when the policy kept every choice
BETWEEN_SEQUENCES = ("reset", "carry")


def patch_model(
    model: nn.Module,
    routing: RoutingConfig,
    *,
    eviction: str = "lru",
    capacity: int | float | str | None = None,
    scope: str = "all",
    between_sequences: str = "reset",
    initial: str | Iterable[int] | None = None,
    seed: int = 0,
    gamma: float = DEFAULT_GAMMA,
    record: bool = False,
    freq_LE: np.ndarray | torch.Tensor | None = None,
    replace_rank: int | None = None,
) -> "MoEPatch":
    """Install ``routing`` and one live expert cache per MoE layer into a loaded transformers MoE model.

    model: a ``*ForCausalLM`` of a supported ``model_type`` (see ``SUPPORTED_MODEL_TYPES``), in eval mode.
    routing: the routing policy. eviction: 'lru' | 'lfu' | 'gamma' (``gamma`` its discount).
    capacity: experts per layer cache, an int count or a fraction of E (``0.5``); None = no cache (every
        expert resident: cache-aware policies then equal top-K).
    scope: 'all' | 'generation' (see the module docstring). between_sequences: 'reset' | 'carry'.
    initial, seed: initial cache contents ('random' draws C experts with ``seed + layer``).
    record: keep per-token router logits, selected ids and weights for :meth:`MoEPatch.trace`.
    freq_LE: [L, E] activation-frequency profile for 'eras-bias'.
    replace_rank: sensitivity perturbation, 1-based rank r in [1, K] whose expert is replaced by a random
        expert outside the top-K (``policy='original'`` only; see the module docstring).

    Returns the :class:`MoEPatch` (also a context manager that unpatches on exit). Raises ValueError for an
    unsupported model type, an option out of range or a policy the family cannot express exactly.
    """
    return MoEPatch(model, routing, eviction=eviction, capacity=capacity, scope=scope,
                    between_sequences=between_sequences, initial=initial, seed=seed, gamma=gamma,
                    record=record, freq_LE=freq_LE, replace_rank=replace_rank)


def _as(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` in ``like``'s dtype (no call when it already is: the lean path pays every call per token and layer)."""
    return x if x.dtype == like.dtype else x.to(like.dtype)


def _same_sets(a_PK: torch.Tensor, b_PK: torch.Tensor) -> bool:
    """Whether every row of ``a_PK`` holds the same ids as that row of ``b_PK`` (in any order)."""
    a, b = a_PK.numpy(), b_PK.numpy()
    if a.shape != b.shape:
        return False
    if a.shape[1] > 1:
        a, b = np.sort(a, axis=1), np.sort(b, axis=1)
    return bool((a == b).all())


class MoEPatch:
    """A patched model's routing state: policy, per-row per-layer caches, recording. See the module
    docstring for the semantics; build it with :func:`patch_model`."""

    def __init__(self, model, routing: RoutingConfig, *, eviction, capacity, scope, between_sequences, initial,
                 seed, gamma, record, freq_LE, replace_rank=None) -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        if between_sequences not in BETWEEN_SEQUENCES:
            raise ValueError(f"between_sequences must be one of {BETWEEN_SEQUENCES}, got {between_sequences!r}")
        if eviction_rule(eviction).offline:
            raise ValueError(f"{eviction} needs the future requests, which a live run only decides as it goes; "
                             "record a trace and use expertcache.sim.replay(..., eviction='belady')")
        if getattr(model, "_expertcache_patch", None) is not None:
            raise RuntimeError("model is already patched; call .unpatch() on the existing MoEPatch first")
        self.model = model
        self.family: Family = family_for(model)
        self.layers: list[MoELayer] = find_moe_layers(model, self.family)
        self.routing = routing
        self.num_experts = self.layers[0].num_experts
        self.top_k = self.layers[0].top_k
        router0 = self.layers[0].router
        for m in self.layers:
            bad = self.family.unsupported_policies(m.router)
            if routing.policy in bad:
                raise ValueError(f"{self.family.model_type} (layer {m.layer_id}): policy {routing.policy!r} "
                                 f"{bad[routing.policy]}")
        self.renormalize = bool(self.family.renormalize(router0))
        freq = None if freq_LE is None else torch.as_tensor(np.asarray(freq_LE), dtype=torch.float32)
        if freq is not None and tuple(freq.shape) != (len(self.layers), self.num_experts):
            raise ValueError(f"freq_LE must be [L={len(self.layers)}, E={self.num_experts}], got {tuple(freq.shape)}")
        self.router = Router(routing, num_experts=self.num_experts, k=self.top_k, renormalize=self.renormalize,
                             scoring=self.family.scoring, freq_LE=freq)
        if replace_rank is not None:
            if routing.policy != "original":
                raise ValueError(f"replace_rank is a perturbation of the original routing; got policy {routing.policy!r}")
            if not 1 <= int(replace_rank) <= self.top_k or self.top_k >= self.num_experts:
                raise ValueError(f"replace_rank must be in [1, K={self.top_k}] with K < E={self.num_experts}, "
                                 f"got {replace_rank}")
        self.replace_rank = None if replace_rank is None else int(replace_rank)
        self._replace_gen = torch.Generator().manual_seed(seed)
        self.eviction = eviction
        self.capacity = None if capacity is None else resolve_capacity(capacity, self.num_experts)
        self.scope = scope
        self.between_sequences = between_sequences
        self.initial = initial
        self.seed = seed
        self.gamma = gamma
        self.record = record
        # parts: the live caches (per row and layer, deferred serving, statistics) and the recording
        self.streams = CacheStreams(None if self.capacity is None else self._new_caches, num_layers=len(self.layers),
                                    num_experts=self.num_experts, between_sequences=between_sequences)
        self.recording = Recording(num_layers=len(self.layers), num_experts=self.num_experts, top_k=self.top_k)
        # state
        self._batch: int | None = None  # B of the model forward being run (from its input ids / embeddings)
        self._attention_mask: torch.Tensor | None = None
        self._mask_host: torch.Tensor | None = None
        self._hooks: list[Any] = []
        self._patched = False
        self._ensure_rows(1)  # row 0's caches now, not in the first forward
        # the lean per-call path (_route_lean) applies to this configuration
        self._lean_original = routing.policy == "original" and replace_rank is None
        self._lean = (self.capacity is not None and not record and replace_rank is None
                      and (self._lean_original or routing.cache_aware))
        self._install()

    # -- installation ---------------------------------------------------------------------------

    def _install(self) -> None:
        base = self.model.model
        self._hooks.append(base.register_forward_pre_hook(self._capture_mask, with_kwargs=True))
        self._hooks.append(base.register_forward_hook(self._clear_mask, with_kwargs=True))
        self._previous_forwards = []
        for m in self.layers:
            # an instance-level forward (e.g. accelerate's offload hooks) is wrapped, not bypassed
            self._previous_forwards.append(m.router.__dict__.get("forward"))
            m.router.forward = self._make_forward(m, m.router.forward)
        self.model._expertcache_patch = self
        self._patched = True

    def unpatch(self) -> None:
        """Restore the stock routers and remove every hook (idempotent). Caches and recordings stay readable."""
        if not self._patched:
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m, previous in zip(self.layers, self._previous_forwards):
            if previous is None:
                del m.router.forward
            else:
                m.router.forward = previous
        self.model._expertcache_patch = None
        self._patched = False

    def __enter__(self) -> "MoEPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def _capture_mask(self, module, args, kwargs) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self._attention_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        self._mask_host = None  # its host copy, made by the first layer that needs it (one transfer a forward)
        x = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(x, torch.Tensor):
            x = kwargs.get("inputs_embeds")
        self._batch = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() >= 2 else None

    def _clear_mask(self, module, args, kwargs, output) -> None:
        self._attention_mask = None
        self._batch = None

    def _rows(self, t: int) -> tuple[int, int]:
        """(B, S) of a router call over T = B·S tokens (one row if the batch size is unknown)."""
        b = self._batch
        if b is None or b < 1 or t % b:
            return 1, t
        return b, t // b

    def _make_forward(self, m: MoELayer, stock_forward):
        def forward(hidden_states, *args, **kwargs):
            if m.router.training:
                raise RuntimeError("expertcache-patched routers are inference-only; call model.eval()")
            logits_TE, weights_TK, ids_TK = stock_forward(hidden_states, *args, **kwargs)
            weights_TK, ids_TK = self._route(m, logits_TE, weights_TK, ids_TK)
            return logits_TE, weights_TK, ids_TK

        return forward

    def describe(self) -> dict[str, Any]:
        """The resolved configuration of this patch (JSON-serialisable), for result rows."""
        cfg = self.model.config
        return dict(mode="closed-loop", version=__version__, model=str(getattr(cfg, "_name_or_path", "") or ""),
                    model_type=self.family.model_type, num_experts=self.num_experts, top_k=self.top_k,
                    moe_layers=[m.layer_id for m in self.layers], routing=self.routing.to_dict(),
                    policy_ranks_logits=ranks_logits(self.family, self.layers[0].router),
                    eviction=self.eviction, capacity=self.capacity, gamma=self.gamma, scope=self.scope,
                    between_sequences=self.between_sequences,
                    initial=self.initial if self.initial is None or isinstance(self.initial, str)
                    else sorted(int(e) for e in self.initial), seed=self.seed, replace_rank=self.replace_rank)

    # -- the parts: caches and recording ------------------------------------------------------------

    def _new_caches(self) -> list[ExpertCache]:
        """Fresh caches for one batch row, one per MoE layer (the factory of :attr:`streams`)."""
        return [make_cache(self.eviction, self.num_experts, self.capacity, initial=self.initial,
                           seed=self.seed + m.index, gamma=self.gamma) for m in self.layers]

    def _ensure_rows(self, rows: int) -> None:
        self.streams.ensure_rows(rows)
        self.recording.ensure_rows(rows)

    @property
    def caches(self) -> list[ExpertCache]:
        """The live caches of batch row 0, one per MoE layer (empty list without a cache)."""
        return self.streams.caches

    @property
    def row_caches(self) -> list[list[ExpertCache]]:
        """All live caches, ``[row][layer]``."""
        return self.streams.row_caches

    def reset_caches(self) -> None:
        """Replace every cache by a fresh one (initial state); statistics so far are kept in ``stats()``."""
        self.streams.reset_caches()

    def new_sequence(self) -> None:
        """End the current sequence(s): close their recording; with ``between_sequences='reset'`` also
        start fresh caches; then call the hooks of :meth:`on_new_sequence` in the order they were added."""
        self.recording.finish_sequence()
        self.streams.new_sequence()

    def on_new_sequence(self, hook) -> None:
        """Call ``hook()`` at the end of every :meth:`new_sequence` (e.g. a prefetcher loading the next item's
        experts into the fresh caches): the named seam for observers, instead of replacing the method."""
        self.streams.on_new_sequence(hook)

    def stats(self):
        """Cache statistics so far as an :class:`expertcache.sim.SimResult` (``per_layer`` CacheStats,
        ``overall``, ``miss_rate`` = misses / (tokens · L · K), ``to_row()``), over all rows and sequences."""
        if self.capacity is None:
            raise ValueError("this patch has no cache (capacity=None): there are no cache statistics")
        return SimResult(self.streams.per_layer(), top_k=self.top_k, config=self.describe())

    def trace(self) -> RoutingTrace:
        """A :class:`expertcache.trace.RoutingTrace` of everything recorded so far (finished sequences, then
        the rows of the current one; one sequence per row per ``new_sequence``), with the router logits,
        the selected ids (descending weight, -1 = dropped) and their combine weights."""
        if not self.record:
            raise ValueError("nothing recorded: patch the model with record=True")
        logits, ids, weights, starts = self.recording.arrays()
        d = self.describe()
        meta = TraceMeta(model=d["model"] or self.family.model_type, num_experts=self.num_experts, top_k=self.top_k,
                         renormalize=self.renormalize, num_layers=len(self.layers), scoring=self.family.scoring,
                         source="live:" + self.family.model_type, layer_ids=[m.layer_id for m in self.layers],
                         sequence_starts=starts, extra={"patch": d})
        return RoutingTrace(logits_TLE=logits, ids_TLK=ids, meta=meta, weights_TLK=weights)

    # -- routing ----------------------------------------------------------------------------------

    def _real_tokens(self, b: int, s: int) -> torch.Tensor:
        """bool [B, S]: which new tokens are real (not padding)."""
        mask = self._attention_mask
        if mask is None:
            return torch.ones(b, s, dtype=torch.bool)
        if mask.shape[0] != b or mask.shape[1] < s:
            raise RuntimeError(f"attention_mask {tuple(mask.shape)} does not cover the batch of {b} rows × "
                               f"{s} new tokens")
        if self._mask_host is None:
            self._mask_host = to_host(mask)
        return self._mask_host[:, -s:] != 0

    def _route(self, m: MoELayer, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor):
        if self._lean:
            out = self._route_lean(m, z_TE, w0_TK, ids0_TK)
            if out is not None:
                return out
        has_policy = self.routing.policy != "original" or self.replace_rank is not None
        if not has_policy and self.capacity is None and not self.record:
            return w0_TK, ids0_TK  # nothing to route, serve or record
        t = z_TE.shape[0]
        b, s = self._rows(t)
        real_BS = None if self._attention_mask is None else self._real_tokens(b, s)
        if real_BS is not None and bool(real_BS.all()):
            real_BS = None  # no padding: a row's tokens are one slice (no index tensors)
        rows = []  # (row, flat token positions of its real tokens)
        for row in range(b):
            if real_BS is None:
                rows.append((row, slice(row * s, (row + 1) * s)))
            else:
                pos = torch.nonzero(real_BS[row]).flatten() + row * s
                if pos.numel():
                    rows.append((row, pos))
        self._ensure_rows(b)
        # what the host needs of the router's output in one device -> host transfer (none on the CPU)
        z_cpu_TE, ids_cpu_TK, w0_cpu_TK = to_host_many(z_TE.detach(), ids0_TK.detach(), w0_TK.detach())
        if not (has_policy and not (self.scope == "generation" and s > 1)):
            self._observe(m, z_cpu_TE, ids_cpu_TK, rows, real_BS)
            return w0_TK, ids0_TK
        zr_TE, allowed_TE = self.family.ranking(m.router, z_cpu_TE)
        selected = []  # (row, pos, ids_PK) in descending-logit order
        for row, pos in rows:
            cache = self.streams.rows[row][m.index] if self.capacity is not None else None
            if cache is not None and self.streams.pending:
                self.streams.flush((row, m.index))
            z_PE = z_cpu_TE[pos]
            if self.replace_rank is not None:
                ids_PK = self._replaced(order_by_logits(ids_cpu_TK[pos], z_PE), z_PE)
                if cache is not None:
                    cache.serve_array(ids_PK.numpy())
            else:
                ids_PK = self._select(m.index, zr_TE[pos], z_PE, None if allowed_TE is None else allowed_TE[pos],
                                      cache)
            selected.append((row, pos, ids_PK))
        if not self.record and t <= _SAME_SET_CHECK and all(_same_sets(ids_PK, ids_cpu_TK[pos])
                                                             for _, pos, ids_PK in selected):
            return w0_TK, ids0_TK  # the policy kept the model's own choice for every token: its own weights
        one_slice = len(selected) == 1 and real_BS is None  # batch 1 (the common case): no scatter
        if not one_slice:
            ids_out_TK = ids_cpu_TK.clone()
            w_out_TK = w0_cpu_TK.clone()
        for row, pos, ids_PK in selected:
            z_PE = z_cpu_TE[pos]
            w_PK = self.family.weights(m.router, z_PE, ids_PK)
            filled_PK = ids_PK
            if self.routing.policy == "prune":  # dropped slot: slot 0's expert again, weight 0
                filled_PK = torch.where(ids_PK >= 0, ids_PK, ids_PK[:, :1])
            if self.record:
                self.recording.record(row, m.index, z_PE, ids_PK, w_PK)
            if one_slice:
                ids_out_TK, w_out_TK = filled_PK.to(ids0_TK.dtype), w_PK.to(w0_TK.dtype)
            else:
                ids_out_TK[pos] = filled_PK.to(ids_out_TK.dtype)
                w_out_TK[pos] = w_PK.to(w_out_TK.dtype)
        return to_device(w_out_TK, w0_TK.device), to_device(ids_out_TK, ids0_TK.device)

    def _route_lean(self, m: MoELayer, z_TE: torch.Tensor, w0_TK: torch.Tensor, ids0_TK: torch.Tensor):
        """The common case with less Python per call (decoding pays it per token and layer): one row, no
        padding, float32 CPU logits, the original policy or a cache-aware one (LRU) in scope, nothing
        recorded. Same result as the general path; None when the call is not such a case."""
        t = z_TE.shape[0]
        if (self._attention_mask is not None or (self._batch or 1) != 1 or z_TE.dtype != torch.float32
                or not on_host(z_TE.device) or (t > 1 and self.scope == "generation")):
            return None
        if z_TE.requires_grad:
            z_TE = z_TE.detach()
        streams = self.streams
        if self._lean_original:  # served later, in bulk (see CacheStreams.flush)
            streams.queue(0, m.index, ids0_TK.detach(), z_TE)
            return w0_TK, ids0_TK
        cache = streams.rows[0][m.index]
        if streams.pending:
            streams.flush((0, m.index))
        zr_TE, allowed_TE = self.family.ranking(m.router, z_TE)
        ids_TK = self._select(m.index, zr_TE, z_TE, allowed_TE, cache)
        if t == 1:
            if sorted(ids_TK.tolist()[0]) == sorted(ids0_TK.tolist()[0]):
                return w0_TK, ids0_TK  # the policy kept the model's own choice: its own weights
        elif t <= _SAME_SET_CHECK and _same_sets(ids_TK, ids0_TK.detach()):
            return w0_TK, ids0_TK
        w_TK = self.family.weights(m.router, z_TE, ids_TK)
        return _as(w_TK, w0_TK), _as(ids_TK, ids0_TK)

    def _observe(self, m: MoELayer, z_cpu_TE, ids_cpu_TK, rows, real_BS) -> None:
        """A call routed by the model itself (original policy, or outside the policy's scope): feed the
        caches (deferred, in bulk, unless recording), Cache-Prior's running Δavg and the recording."""
        if self.routing.policy in CACHE_PRIOR:  # 001 Eq. 10: Δavg averages every token, the prompt's too
            zr_TE, _ = self.family.ranking(m.router, z_cpu_TE)
            self.router.delta_for(m.index).update(zr_TE if real_BS is None else zr_TE[real_BS.reshape(-1)])
        for row, pos in rows:
            if self.capacity is not None and not self.record:
                self.streams.queue(row, m.index, ids_cpu_TK[pos], z_cpu_TE[pos])
                continue
            z_PE = z_cpu_TE[pos]
            ids_PK = order_by_logits(ids_cpu_TK[pos], z_PE)
            if self.capacity is not None:
                if self.streams.pending:
                    self.streams.flush((row, m.index))
                self.streams.rows[row][m.index].serve_array(ids_PK.numpy())
            if self.record:
                self.recording.record(row, m.index, z_PE, ids_PK, self.family.weights(m.router, z_PE, ids_PK))

    def _replaced(self, ids_PK: torch.Tensor, z_PE: torch.Tensor) -> torch.Tensor:
        """``ids_PK`` (the original top-K, descending logit) with the expert at rank ``replace_rank`` replaced by
        a uniformly drawn expert outside the top-K, re-ordered by descending logit."""
        p, e = z_PE.shape
        u_PE = torch.rand(p, e, generator=self._replace_gen)
        u_PE.scatter_(1, ids_PK.clamp(min=0), -1.0)  # never draw a top-K expert
        ids_PK = ids_PK.clone()
        ids_PK[:, self.replace_rank - 1] = u_PE.argmax(dim=1)
        return order_by_logits(ids_PK, z_PE)

    def _select(self, layer: int, zr_PE, z_PE, allowed_PE, cache: ExpertCache | None) -> torch.Tensor:
        """The policy's ids [P, K] for P consecutive tokens of one row, token by token against the live
        cache (each token's ``access_step`` before the next token is ranked), ordered by descending logit."""
        if cache is None or not self.routing.cache_aware:
            resident_PE = torch.ones_like(zr_PE, dtype=torch.bool)
            if allowed_PE is not None:
                resident_PE = resident_PE & allowed_PE
            ids_PK = order_by_logits(self.router.rank(layer, zr_PE, resident_PE), z_PE)
            if cache is not None:
                cache.serve_array(ids_PK.numpy())
            return ids_PK
        # keys, selection and serving in one kernel call
        ids_PK = fused.keyed_serve(self.router, layer, zr_PE, z_PE, allowed_PE, cache)
        if ids_PK is not None:
            return torch.from_numpy(ids_PK)
        # a router deciding token by token (routing.budget.BudgetRouter: its strength moves with each token's
        # misses): its rank on one token at a time against the live residency, then served
        out: list[list[int]] = []
        for p in range(zr_PE.shape[0]):
            resident_1E = torch.tensor(cache.resident_mask()).unsqueeze(0)
            if allowed_PE is not None:
                resident_1E = resident_1E & allowed_PE[p:p + 1]
            ids = order_by_logits(self.router.rank(layer, zr_PE[p:p + 1], resident_1E), z_PE[p:p + 1])[0].tolist()
            cache.access_step(ids)
            out.append(ids)
        return torch.tensor(out, dtype=torch.long).reshape(len(out), self.top_k)

"""Per-family routing rules of Hugging Face MoE models (transformers 5.x layouts).

Letter legend: T tokens (batch rows flattened, row-major), E routed experts, K experts per token,
D hidden size, G expert groups.

In transformers 5.x every supported MoE block is ``router -> experts``: a router module (attribute
``gate`` or ``router``) returns ``(router_logits_TE, weights_TK, ids_TK)`` and an experts module with
stacked weights consumes ``(hidden_TD, ids_TK, weights_TK)``. This module knows, for each family:

- where the MoE blocks and their routers are, and which decoder layers must be MoE (checked loudly);
- the *ranking input* a routing policy ranks (the raw logits for most models; DeepSeek-V3 ranks the
  bias-corrected sigmoid scores) and which experts are allowed at all (group-limited top-k);
- the model's *own* weight rule for an arbitrary set of selected ids (``weights``), so that a
  re-ranked selection is weighted exactly as the model would weight it.

Contracts (pinned by tests):

- ``weights(router, z_TE, ids_TK)`` with the model's original top-K ids reproduces the weights the stock
  router returns (same formula, same dtype);
- ``ids_TK`` passed to ``weights`` are ordered by descending router logit, dropped slots (-1) last; a
  dropped slot gets weight 0;
- shared experts (Qwen2-MoE ``shared_expert``, DeepSeek ``shared_experts``) are outside the router
  seam and never cached or re-routed; dense layers (DeepSeek ``first_k_dense_replace``, Qwen
  ``mlp_only_layers``/``decoder_sparse_step``) have no router and are skipped.

Per family (router seam, policy ranking input, weight rule):

============  ==============  ==========================================  ==========================================
model_type    router          policies rank                               weights of the selected ids
============  ==============  ==========================================  ==========================================
olmoe         ``mlp.gate``    logits                                      softmax(z)[ids], renorm iff norm_topk_prob
qwen2_moe     ``mlp.gate``    logits (shared expert untouched)            same
qwen3_moe     ``mlp.gate``    logits                                      same
mixtral       ``mlp.gate``    logits                                      softmax(z)[ids], always renormalised
deepseek_v2   ``mlp.gate``    logits; group_limited_greedy: logits of     softmax(z)[ids] · routed_scaling_factor
                              the model's top groups only                 (no renormalisation, as in transformers)
deepseek_v3   ``mlp.gate``    sigmoid(z) + e_score_correction_bias,       sigmoid(z)[ids], renorm iff norm_topk_prob,
                              within the model's top groups               · routed_scaling_factor
phimoe        ``mlp.router``  logits                                      sparsemixer at the given ids (see below)
gpt_oss       ``mlp.router``  logits (router bias included)               softmax(z[ids]) = softmax(z) renormalised
============  ==============  ==========================================  ==========================================

``cumsum`` and ``eras-threshold`` read router probabilities as softmax(z) over all E for every softmax
family (PhiMoE and GPT-OSS included, whose combine weights follow their own rule) and sigmoid(z) for
DeepSeek-V3 without bias or group limit.

Refused (ValueError at patch time): ``cumsum`` and ``eras-threshold`` on DeepSeek-V3 with a non-zero
correction bias or a group limit, and on DeepSeek-V2 with ``group_limited_greedy``: both need the
probabilities of the ranked experts, and there the ranking variable is not the model's probability
(biased / group-restricted), so the core policies cannot express them exactly. Group selection itself is
never changed by a policy: experts outside the model's chosen groups are neither promoted nor selected.
For DeepSeek-V3 Cache-Prior's Δavg and ERAS-bias's penalty are in the units of the biased sigmoid score.

Each model type is declared once, as one :class:`Family` in ``FAMILIES`` (as torchtitan registers a model
once): its router seam and rules above, where its weights are on disk (:class:`DiskLayout`, plain data that
``offload/checkpoint.py``, ``offload/loader.py`` and ``offload/make_model.py`` read) and its tiny random test
configs (``Family.tiny``, built by :mod:`expertcache.models.tiny`). No other module names a model type
(``tests/test_families.py`` pins it); docs/ARCHITECTURE.md has the recipe for adding one.

Nothing here holds state; the stateful patch lives in :mod:`expertcache.models.patch`.
"""

from __future__ import annotations

import weakref
from dataclasses import KW_ONLY, dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from expertcache.cache.base import order_steps
from expertcache.routing import kernels as _rk
from expertcache.routing.registry import NEEDS_PROBS

__all__ = ["DiskLayout", "Family", "FAMILIES", "SUPPORTED_MODEL_TYPES", "register_family", "family_for", "MoELayer",
           "find_moe_layers", "order_by_logits", "order_row", "ranks_logits"]


def order_by_logits(ids_TK: torch.Tensor, z_TE: torch.Tensor) -> torch.Tensor:
    """``ids_TK`` sorted by descending logit ``z_TE`` (stable; -1 slots last; :func:`expertcache.cache.base.
    order_steps`). Every supported model's combine weight is monotone in its own logit, so this is the
    descending-weight order the caches need (001 Sec. 4.2: the higher-weight expert is evicted first)."""
    if ids_TK.shape[0] == 1 and ids_TK.device.type == "cpu" and z_TE.device.type == "cpu":
        # one token (decoding): the same stable order with Python's sort, not six numpy calls per layer
        return torch.tensor([order_row(ids_TK[0].tolist(), z_TE[0].tolist())], dtype=ids_TK.dtype, device="cpu")
    ids = order_steps(ids_TK.detach().cpu().numpy(), z_TE.detach().float().cpu().numpy())
    return torch.from_numpy(np.ascontiguousarray(ids)).to(ids_TK.device)


def order_row(ids: list[int], z: list[float]) -> list[int]:
    """One token's :func:`order_by_logits` on Python lists: ``ids`` (-1 = dropped) by descending logit ``z[e]``
    (the token's E logits as floats, e.g. ``z_E.tolist()`` of float32 / bf16 values: exact), stable, -1 last."""
    key = [-z[e] if e >= 0 else float("inf") for e in ids]
    return [ids[i] for i in sorted(range(len(ids)), key=key.__getitem__)]


def _no_dropped(ids_TK: torch.Tensor) -> bool:
    """True when ``ids_TK`` (on the CPU: no device sync) has no dropped slot, so a plain gather will do."""
    if not ids_TK.is_cpu or ids_TK.numel() == 0:
        return False
    if ids_TK.dim() == 2 and ids_TK.shape[0] == 1:  # one token (decoding): its K ids as a list, no tensor op
        return min(ids_TK.tolist()[0]) >= 0
    return int(ids_TK.min()) >= 0


def _gather_valid(scores_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """scores at ids; 0 at dropped (-1) slots."""
    if _no_dropped(ids_TK):  # the common case, with 3 fewer tensor ops (decoding pays them per token and layer)
        return scores_TE.gather(1, ids_TK)
    return scores_TE.gather(1, ids_TK.clamp(min=0)).masked_fill(ids_TK < 0, 0)


# ---------------------------------------------------------------------------------------------
# families


@dataclass(frozen=True)
class DiskLayout:
    """Where a family's weights are in a safetensors checkpoint (what transformers 5.x ``save_pretrained`` writes
    for it). Plain data, no torch: ``offload/checkpoint.py`` finds each expert's byte ranges with it,
    ``offload/loader.py`` the non-expert tensors, ``offload/make_model.py`` names the tensors it writes.

    expert_block: the MoE block's name in the per-expert keys ``model.layers.{i}.{expert_block}.experts.{e}.{part}
    .weight``. expert_parts: the (gate, up, down) ``part`` names of those keys ([F, D], [F, D], [D, F]), or None
    when the family stores only fused tensors. fused: the layout of the fused tensors ``model.layers.{i}.mlp.experts.
    gate_up_proj`` / ``down_proj`` (transformers' in-memory names, also accepted on disk): ``'linear'`` ([E, 2F, D]
    gate rows first, [E, D, F]) or ``'interleaved'`` ([E, D, 2F] gate and up interleaved along the last axis,
    [E, F, D], each with a ``_bias`` tensor; used as ``x @ W``: GPT-OSS). renames: (in-memory, on-disk) substring
    pairs applied in order to a non-expert tensor's name for the key it may have on disk instead.
    """

    expert_block: str = "mlp"
    expert_parts: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")
    fused: str = "linear"
    renames: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.fused not in ("linear", "interleaved"):
            raise ValueError(f"DiskLayout.fused must be 'linear' or 'interleaved', got {self.fused!r}")
        if self.fused == "interleaved" and self.expert_parts is not None:
            raise ValueError("an 'interleaved' (biased) expert layout has no per-expert keys: expert_parts=None")

    def expert_keys(self, layer_id: int, e: int) -> tuple[str, str, str] | None:
        """The per-expert (gate, up, down) keys of expert ``e`` of decoder layer ``layer_id`` (None: fused only)."""
        if self.expert_parts is None:
            return None
        p = f"model.layers.{layer_id}.{self.expert_block}.experts.{e}."
        return tuple(f"{p}{part}.weight" for part in self.expert_parts)

    @staticmethod
    def fused_keys(layer_id: int) -> tuple[str, str]:
        """The fused (gate_up, down) keys of decoder layer ``layer_id``."""
        p = f"model.layers.{layer_id}.mlp.experts."
        return p + "gate_up_proj", p + "down_proj"

    def disk_keys(self, name: str) -> list[str]:
        """Checkpoint keys that may hold the in-memory non-expert tensor ``name``: the name itself, then the
        renamed one (transformers renames some keys on load)."""
        disk = name
        for memory, stored in self.renames:
            disk = disk.replace(memory, stored)
        return [name] if disk == name else [name, disk]


#: transformers' own per-expert layout (OLMoE, Qwen2/3-MoE, DeepSeek-V2/V3): ``mlp.experts.{e}.{gate,up,down}_proj``
_PER_EXPERT = DiskLayout()
#: Mixtral and PhiMoE keep their original checkpoint names: ``block_sparse_moe`` for ``mlp``, experts ``w1, w3,
#: w2``, and PhiMoE's ``mlp.router`` is ``block_sparse_moe.gate``
_BLOCK_SPARSE = DiskLayout("block_sparse_moe", ("w1", "w3", "w2"), renames=((".mlp.router.", ".block_sparse_moe.gate."),
                                                                           (".mlp.", ".block_sparse_moe.")))
#: GPT-OSS: fused only, gate/up interleaved, with biases
_INTERLEAVED = DiskLayout(expert_parts=None, fused="interleaved")

#: the tiny DeepSeek configs' shared fields: 3 layers, the first dense, one shared expert, MLA attention
_TINY_DEEPSEEK = dict(intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
                      n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, head_dim=8, num_key_value_heads=4)


@dataclass(frozen=True)
class Family:
    """How one transformers model family routes, where its weights are, and its tiny test configs.

    model_type: ``config.model_type``. router_attr: the MoE block's router attribute. router_class: the
    expected router class name (checked). block_class: the expected MoE block class name (checked).
    scoring: 'softmax' or 'sigmoid' (the score the combine weights come from).
    unsupported_policies(router): routing policies this family cannot express exactly (raise if asked).
    disk: where its weights are in a checkpoint (:class:`DiskLayout`). tiny: its tiny random test configs,
    name → config fields over :mod:`expertcache.models.tiny`'s common ones (the first is named ``model_type``;
    a variant covers a routing mode the first does not, e.g. ``deepseek_v2_grouped``).
    """

    model_type: str
    router_attr: str
    router_class: str
    block_class: str
    scoring: str
    renormalize: Callable[[nn.Module], bool]
    weights: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    ranking: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
    expected_moe_layers: Callable[[object], list[int]]
    unsupported_policies: Callable[[nn.Module], dict[str, str]] = lambda router: {}
    _: KW_ONLY
    disk: DiskLayout
    tiny: dict[str, dict] = field(hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.disk, DiskLayout):
            raise TypeError(f"{self.model_type}: Family.disk must be a DiskLayout, got {type(self.disk).__name__}")
        if next(iter(self.tiny), None) != self.model_type:
            raise ValueError(f"{self.model_type}: Family.tiny must start with a config named {self.model_type!r}, "
                             f"got {list(self.tiny)}")


# -- rank inputs ---------------------------------------------------------------------------------


def _rank_logits(router: nn.Module, z_TE: torch.Tensor):
    """Plain top-K over the logits: the policy ranks the logits, every expert allowed."""
    return z_TE, None


def _rank_deepseek_v2(router: nn.Module, z_TE: torch.Tensor):
    """'greedy' (V2-Lite): top-K of softmax = top-K of logits. 'group_limited_greedy': only experts of the
    ``topk_group`` groups with the highest max-score are allowed (the model's own group choice)."""
    if router.topk_method == "greedy" or not _group_limited(router):
        return z_TE, None
    if router.topk_method != "group_limited_greedy":
        raise NotImplementedError(f"deepseek_v2 topk_method {router.topk_method!r} is not supported")
    scores_TE = z_TE.float().softmax(dim=-1)
    g = router.num_group
    group_scores_TG = scores_TE.view(-1, g, router.num_experts // g).max(dim=-1).values
    return _group_restricted(z_TE.float(), group_scores_TG, router)


_BIAS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _correction_bias(router: nn.Module, device: torch.device) -> tuple[torch.Tensor, bool]:
    """(float32 correction bias on ``device``, whether any entry is non-zero), cached per router until the
    buffer changes (its version counter or storage)."""
    b = router.e_score_correction_bias
    key = (b.data_ptr(), b._version, device)
    hit = _BIAS.get(router)
    if hit is None or hit[0] != key:
        bias_E = b.float().to(device)
        hit = _BIAS[router] = (key, bias_E, bool(bias_E.any()))
    return hit[1], hit[2]


def _rank_deepseek_v3(router: nn.Module, z_TE: torch.Tensor):
    """The model ranks ``sigmoid(z) + e_score_correction_bias`` within its top ``topk_group`` groups (group
    score = sum of the two best biased scores). With a zero bias and no group limit this is the same
    order as the logits, which are then ranked directly."""
    bias_E, any_bias = _correction_bias(router, z_TE.device)
    if not _group_limited(router) and not any_bias:
        return z_TE, None
    choice_TE = z_TE.float().sigmoid() + bias_E
    if not _group_limited(router):
        return choice_TE, None
    g = router.num_group
    group_scores_TG = choice_TE.view(-1, g, router.num_experts // g).topk(2, dim=-1)[0].sum(dim=-1)
    return _group_restricted(choice_TE, group_scores_TG, router)


def _group_restricted(values_TE: torch.Tensor, group_scores_TG: torch.Tensor, router: nn.Module):
    """(ranking values, allowed mask) of a group-limited router: the model's own choice of its
    ``topk_group`` best groups (``torch.topk``, as transformers picks them), the rest pushed below
    (:func:`expertcache.routing.kernels.restrict_to_groups`, one kernel call instead of a dozen tensor ops,
    which decoding pays per token and layer)."""
    groups_TJ = torch.topk(group_scores_TG, k=router.topk_group, dim=-1, sorted=False)[1]
    v_TE, ok_TE = _rk.restrict_to_groups(values_TE.detach().float().cpu().numpy(), groups_TJ.cpu().numpy(),
                                         router.num_experts // router.num_group)
    return torch.from_numpy(v_TE).to(values_TE.device), torch.from_numpy(ok_TE).to(values_TE.device)


def _group_limited(router: nn.Module) -> bool:
    g, tg = getattr(router, "num_group", None), getattr(router, "topk_group", None)
    return bool(g) and g > 1 and tg is not None and tg < g


# -- weight rules (the model's formula for any ids) ---------------------------------------------


def _weights_softmax_topk(router: nn.Module, z_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """OLMoE / Qwen2-MoE / Qwen3-MoE / Mixtral: softmax over all E in fp32, gathered, renormalised over the
    selected ids iff ``norm_topk_prob`` (Mixtral always)."""
    w_TK = _gather_valid(torch.softmax(z_TE, dim=-1, dtype=torch.float), ids_TK)
    if _renorm_softmax(router):
        w_TK = w_TK / w_TK.sum(dim=-1, keepdim=True)
    return w_TK


def _renorm_softmax(router: nn.Module) -> bool:
    return bool(getattr(router, "norm_topk_prob", True))  # Mixtral's router has no flag: always renormalises


def _weights_deepseek_v2(router: nn.Module, z_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """softmax over all E (fp32) gathered at the ids, times ``routed_scaling_factor``; no renormalisation
    (the transformers V2 router ignores ``norm_topk_prob``)."""
    return _scaled(_gather_valid(z_TE.float().softmax(dim=-1, dtype=torch.float32), ids_TK), router)


def _scaled(w_TK: torch.Tensor, router: nn.Module) -> torch.Tensor:
    """``w_TK · routed_scaling_factor`` (no op for 1.0, which leaves every value as it is)."""
    scale = router.routed_scaling_factor
    return w_TK if scale == 1.0 else w_TK * scale


def _weights_deepseek_v3(router: nn.Module, z_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """Unbiased ``sigmoid(z)`` gathered at the ids (the correction bias only affects the ranking),
    renormalised iff ``norm_topk_prob`` (denominator + 1e-20 as in the model), times
    ``routed_scaling_factor``."""
    w_TK = _gather_valid(z_TE.float().sigmoid(), ids_TK)
    if router.norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return _scaled(w_TK, router)


def _weights_gpt_oss(router: nn.Module, z_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """softmax over the selected ids' logits (router bias included in the logits); equal to the full
    softmax renormalised over the selected ids. Dropped slots are excluded (-inf)."""
    if _no_dropped(ids_TK):
        return torch.softmax(z_TE.gather(1, ids_TK), dim=1, dtype=z_TE.dtype)
    sel_TK = z_TE.gather(1, ids_TK.clamp(min=0)).masked_fill(ids_TK < 0, float("-inf"))
    return torch.softmax(sel_TK, dim=1, dtype=sel_TK.dtype)


def _weights_phimoe(router: nn.Module, z_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """PhiMoE's eval-mode sparsemixer evaluated at the given ids (K = 2).

    The model takes slot 1 = argmax and weights it by the softmax over the experts whose logit is within
    the relative threshold ``2·router_jitter_noise`` of it; slot 2 = argmax of the rest, weighted by the
    softmax over the rest (slot 1 masked out) within the same threshold of slot 2's logit. Here the
    argmaxes are replaced by the selected ids in order: exact for the original selection. When a policy
    selects a lower-ranked expert for slot 2, experts with higher logits that were not selected stay in
    its softmax (they pass the threshold), so its weight is smaller than if it were the argmax: that is
    the model's formula applied as written, not a re-derivation. With J = 0 slot 1 may also be a
    non-argmax expert and is treated the same way.
    """
    if ids_TK.shape[1] != 2:
        raise ValueError(f"phimoe's sparsemixer routes exactly 2 experts per token, got K={ids_TK.shape[1]}")
    # both slots at once, [T, 2, E] (the same element-wise operations as slot by slot, fewer calls)
    dropped = not _no_dropped(ids_TK)
    ids_T2 = ids_TK.clamp(min=0) if dropped else ids_TK
    thr_T21 = z_TE.gather(1, ids_T2).unsqueeze(-1)  # each slot's own logit
    z_T1E = z_TE.unsqueeze(1)
    far_T2E = ((thr_T21 - z_T1E) / z_TE.abs().unsqueeze(1).clamp(min=thr_T21)) > (2 * router.router_jitter_noise)
    s_T2E = z_T1E.masked_fill(far_T2E, float("-inf"))
    s_T2E[:, 1].scatter_(-1, ids_T2[:, :1], float("-inf"))  # slot 2: the rest, slot 1's expert masked out
    w_T2 = torch.softmax(s_T2E, dim=-1).gather(-1, ids_T2.unsqueeze(-1)).squeeze(-1)
    return w_T2.masked_fill(ids_TK < 0, 0) if dropped else w_T2


# -- which layers are MoE -------------------------------------------------------------------------


def _all_layers(cfg) -> list[int]:
    return list(range(cfg.num_hidden_layers))


def _qwen_layers(cfg) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers)
            if i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0]


def _deepseek_layers(cfg) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace]


_NOT_PROB = ("needs the router probabilities of the ranked experts, but this model ranks {what}; "
             "not expressible with the core policies (see expertcache.models.adapters)")


def _deepseek_v2_unsupported(router: nn.Module) -> dict[str, str]:
    if not _group_limited(router) or router.topk_method == "greedy":
        return {}
    msg = _NOT_PROB.format(what="within the top groups only (group_limited_greedy)")
    return dict.fromkeys(NEEDS_PROBS, msg)  # every policy whose keys read the probabilities (cumsum, ERAS-threshold)


def _deepseek_v3_unsupported(router: nn.Module) -> dict[str, str]:
    if not _group_limited(router) and not bool(router.e_score_correction_bias.any()):
        return {}
    msg = _NOT_PROB.format(what="bias-corrected sigmoid scores within the top groups")
    return dict.fromkeys(NEEDS_PROBS, msg)  # every policy whose keys read the probabilities (cumsum, ERAS-threshold)


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in [
        Family("olmoe", "gate", "OlmoeTopKRouter", "OlmoeSparseMoeBlock", "softmax",
               _renorm_softmax, _weights_softmax_topk, _rank_logits, _all_layers, disk=_PER_EXPERT,
               tiny={"olmoe": dict(intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                   norm_topk_prob=False)}),
        Family("mixtral", "gate", "MixtralTopKRouter", "MixtralSparseMoeBlock", "softmax",
               _renorm_softmax, _weights_softmax_topk, _rank_logits, _all_layers, disk=_BLOCK_SPARSE,
               tiny={"mixtral": dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                                     num_experts_per_tok=2, head_dim=8, sliding_window=None)}),
        Family("qwen2_moe", "gate", "Qwen2MoeTopKRouter", "Qwen2MoeSparseMoeBlock", "softmax",
               _renorm_softmax, _weights_softmax_topk, _rank_logits, _qwen_layers, disk=_PER_EXPERT,
               tiny={"qwen2_moe": dict(intermediate_size=64, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=32, num_hidden_layers=2, num_experts=8,
                                       num_experts_per_tok=4, norm_topk_prob=False)}),
        Family("qwen3_moe", "gate", "Qwen3MoeTopKRouter", "Qwen3MoeSparseMoeBlock", "softmax",
               _renorm_softmax, _weights_softmax_topk, _rank_logits, _qwen_layers, disk=_PER_EXPERT,
               tiny={"qwen3_moe": dict(intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)}),
        Family("deepseek_v2", "gate", "DeepseekV2TopkRouter", "DeepseekV2Moe", "softmax",
               lambda r: False, _weights_deepseek_v2, _rank_deepseek_v2, _deepseek_layers,
               _deepseek_v2_unsupported, disk=_PER_EXPERT,
               tiny={"deepseek_v2": dict(_TINY_DEEPSEEK, n_routed_experts=8, num_experts_per_tok=3,
                                         topk_method="greedy", routed_scaling_factor=1.0),
                     # the full-size V2 routing: group_limited_greedy
                     "deepseek_v2_grouped": dict(_TINY_DEEPSEEK, n_routed_experts=16, num_experts_per_tok=3,
                                                 topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                 routed_scaling_factor=16.0)}),
        Family("deepseek_v3", "gate", "DeepseekV3TopkRouter", "DeepseekV3MoE", "sigmoid",
               lambda r: bool(r.norm_topk_prob), _weights_deepseek_v3, _rank_deepseek_v3, _deepseek_layers,
               _deepseek_v3_unsupported, disk=_PER_EXPERT,
               tiny={"deepseek_v3": dict(_TINY_DEEPSEEK, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                         topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)}),
        Family("phimoe", "router", "PhimoeTopKRouter", "PhimoeSparseMoeBlock", "softmax",
               lambda r: False, _weights_phimoe, _rank_logits, _all_layers, disk=_BLOCK_SPARSE,
               tiny={"phimoe": dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                                    num_experts_per_tok=2, router_jitter_noise=0.01, input_jitter_noise=0.0,
                                    head_dim=8, sliding_window=None)}),
        Family("gpt_oss", "router", "GptOssTopKRouter", "GptOssMLP", "softmax",
               lambda r: True, _weights_gpt_oss, _rank_logits, _all_layers, disk=_INTERLEAVED,
               tiny={"gpt_oss": dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                                     num_experts_per_tok=4, head_dim=8, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})}),
    ]
}

#: the shipped families' model types (``FAMILIES`` is the live registry)
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def register_family(family: Family) -> Family:
    """Add ``family`` to ``FAMILIES`` (from outside the package: a plugin, a test); ValueError if its model type is
    registered already. Everything that names a family (the patch, the offloaded runtime, ``models.tiny``) looks
    it up there when used."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family takes a Family, got {type(family).__name__}")
    if family.model_type in FAMILIES:
        raise ValueError(f"model_type {family.model_type!r} is registered already")
    clash = sorted(set(family.tiny) & {a for f in FAMILIES.values() for a in f.tiny})
    if clash:
        raise ValueError(f"{family.model_type}: tiny config names {clash} are another family's")
    FAMILIES[family.model_type] = family
    return family


def family_for(model_or_config) -> Family:
    """The :class:`Family` of a model (or config) from ``config.model_type``; ValueError listing the
    supported model types otherwise."""
    cfg = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported MoE architecture model_type={model_type!r}; expertcache supports "
                         f"{', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def ranks_logits(family: Family, router: nn.Module) -> bool:
    """Whether policies on this router rank the raw router logits (True for every family except DeepSeek-V3
    with a non-zero correction bias or group limit, and DeepSeek-V2 with group_limited_greedy). When False,
    re-ranking a recorded trace's logits open-loop (``expertcache.sim.simulate``) is not what the live
    model does."""
    z_TE = torch.zeros(1, router.num_experts)
    zr_TE, allowed_TE = family.ranking(router, z_TE)
    return zr_TE is z_TE and allowed_TE is None


# ---------------------------------------------------------------------------------------------
# locating MoE layers


@dataclass
class MoELayer:
    """One MoE layer of a loaded model. ``index`` is its ordinal among MoE layers (the trace's layer axis),
    ``layer_id`` its decoder-layer index."""

    index: int
    layer_id: int
    block: nn.Module
    router: nn.Module
    num_experts: int
    top_k: int


def find_moe_layers(model: nn.Module, family: Family) -> list[MoELayer]:
    """The MoE layers of ``model`` in decoder order, checked against the family's layout: every layer the
    config says is MoE has a ``family.block_class`` block whose router is a ``family.router_class`` with a
    [E, D] weight, and no other layer has one. Raises RuntimeError on any mismatch (loud adapter)."""
    cfg = model.config
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RuntimeError(f"{family.model_type}: expected decoder layers at model.model.layers "
                           f"(a transformers 5.x CausalLM); found {type(layers).__name__}")
    expected = family.expected_moe_layers(cfg)
    found: list[MoELayer] = []
    for i, layer in enumerate(layers):
        block = getattr(layer, "mlp", None)
        router = getattr(block, family.router_attr, None) if block is not None else None
        if router is None or type(router).__name__ != family.router_class:
            continue
        if type(block).__name__ != family.block_class:
            raise RuntimeError(f"{family.model_type} layer {i}: MoE block is {type(block).__name__}, "
                               f"expected {family.block_class} (unsupported transformers layout?)")
        e, k = int(router.num_experts), int(router.top_k)
        weight = router.weight
        if weight.dim() != 2 or weight.shape[0] != e or weight.shape[1] != cfg.hidden_size:
            raise RuntimeError(f"{family.model_type} layer {i}: router weight {tuple(weight.shape)} is not "
                               f"[E={e}, D={cfg.hidden_size}]")
        experts = getattr(block, "experts", None)
        if experts is None or getattr(experts, "num_experts", None) != e:
            raise RuntimeError(f"{family.model_type} layer {i}: experts module missing or not holding E={e} "
                               "stacked experts")
        found.append(MoELayer(len(found), i, block, router, e, k))
    ids = [m.layer_id for m in found]
    if ids != expected:
        raise RuntimeError(f"{family.model_type}: MoE layers found at {ids}, but the config says {expected} "
                           "(unsupported transformers layout?)")
    if not found:
        raise RuntimeError(f"{family.model_type}: the model has no MoE layers")
    shapes = {(m.num_experts, m.top_k) for m in found}
    if len(shapes) != 1:
        raise RuntimeError(f"{family.model_type}: MoE layers differ in (E, K): {sorted(shapes)}")
    return found

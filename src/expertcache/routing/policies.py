"""Routing in torch, around the policy kernels: the original top-K and the pruning baseline, the weights of a
selection, Cache-Prior's Δavg and ERAS biasing's penalty. The cache-aware policies themselves are written once,
as kernels (:mod:`expertcache.routing.kernels`), and run through :class:`expertcache.routing.Router`.

Letter legend: T tokens, E experts (N in the papers), K experts selected per token.

Every policy only changes the *ranking* of experts. The weights of the selected experts always come
from the unmodified logits: ``scores = softmax(z)`` over all E experts (or ``sigmoid(z)`` for
sigmoid-scored models), gathered at the selected ids, renormalised to sum to 1 iff the model
renormalises (``renormalize=True``). Output ids are ordered by descending original score, so the
first id of a row is the one with the highest router weight.

Contracts (pinned by tests):

- every policy returns exactly K distinct ids per token in ``[0, E)``, except ``prune`` which returns
  ``h`` ids and pads the remaining ``K - h`` slots with id ``-1`` and weight 0;
- with zero strength (λ = 0, α = 0, β = 0, p = 0, M ≤ K, h = K) or with every expert resident, a cache-aware
  policy selects exactly the original top-K; with nothing resident besides the top-J, Max-Rank, cumsum,
  Cache-Prior and ERAS thresholding do too (ERAS biasing does not: it penalises non-resident experts by
  β·(1−freq), which differs per expert and can reorder them);
- 001 Appendix B: r = [E1..E6], C = {E3, E4, E6}, M = 4, K = 2, J = 1 selects {E1, E3}.

Specs: 001 (Mixture of Cache-Conditional Experts) Eq. 5-10 and Algorithms 1-2; 003 (MoE-ERAS)
section III-B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = [
    "Selection",
    "DeltaAvg",
    "scores_from_logits",
    "weights_for",
    "topk_rank",
    "prune_rank",
]


@dataclass(frozen=True)
class Selection:
    """The result of routing T tokens.

    ids_TK: int64 [T, K], expert ids ordered by descending original router score; -1 marks a
        dropped slot (``prune`` only).
    weights_TK: float [T, K], combine weights from the unmodified logits; 0 for dropped slots.
    """

    ids_TK: torch.Tensor
    weights_TK: torch.Tensor


# ---------------------------------------------------------------------------------------------
# helpers


def check_logits(z_TE: torch.Tensor, k: int, resident: torch.Tensor | None = None) -> None:
    """ValueError unless ``z_TE`` is float router logits [T, E] without NaN, K in [1, E] and ``resident`` (if
    given) a mask of E experts (per token or shared): the checks every ranking entry point makes first."""
    if z_TE.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(z_TE.shape)}")
    t, e = z_TE.shape
    if not 1 <= k <= e:
        raise ValueError(f"K must be in [1, E={e}], got K={k}")
    if not z_TE.is_floating_point():
        raise ValueError(f"router logits must be floating point, got {z_TE.dtype}")
    total = float(z_TE.sum())  # one reduction; NaN (or +inf + -inf) shows up here
    if total != total and torch.isnan(z_TE).any():
        raise ValueError("router logits contain NaN")
    if resident is not None:
        if resident.dtype != torch.bool:
            raise ValueError(f"residency mask must be bool, got {resident.dtype}")
        if resident.shape not in ((e,), (t, e)):
            raise ValueError(
                f"residency mask must be [E]={e} or [T, E]=({t}, {e}), got {tuple(resident.shape)}"
            )


def scores_from_logits(z_TE: torch.Tensor, scoring: str = "softmax") -> torch.Tensor:
    """Router scores over all E experts, in float32: softmax (most models) or sigmoid (DeepSeek-V3)."""
    if scoring == "softmax":
        return torch.softmax(z_TE.float(), dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(z_TE.float())
    raise ValueError(f"unknown scoring {scoring!r}; expected 'softmax' or 'sigmoid'")


def weights_for(
    ids_TK: torch.Tensor,
    z_TE: torch.Tensor,
    *,
    renormalize: bool,
    scoring: str = "softmax",
    dropped: bool | None = None,
) -> Selection:
    """Order ``ids_TK`` by descending original score and attach weights from the unmodified logits.

    Dropped slots (id -1) get weight 0 and are sorted last. With ``renormalize`` the kept weights of a
    row sum to 1. ``dropped=False`` promises there is no -1 (skips a check on the hot path).
    """
    if dropped is None:
        dropped = bool((ids_TK < 0).any())
    if not dropped:
        # Fast path: order by the selected logits (softmax and sigmoid are monotone), then score only
        # those; renormalised softmax over the selected = softmax of the selected logits.
        z_sel_TK, order_TK = torch.topk(z_TE.gather(1, ids_TK).float(), ids_TK.shape[1], dim=1)
        ids_TK = ids_TK.gather(1, order_TK)
        if scoring == "softmax":
            if renormalize:
                w_TK = torch.softmax(z_sel_TK, dim=1)
            else:
                w_TK = torch.exp(z_sel_TK - torch.logsumexp(z_TE.float(), dim=1, keepdim=True))
        elif scoring == "sigmoid":
            w_TK = torch.sigmoid(z_sel_TK)
            if renormalize:
                w_TK = w_TK / w_TK.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w_TK.dtype).tiny)
        else:
            raise ValueError(f"unknown scoring {scoring!r}; expected 'softmax' or 'sigmoid'")
        return Selection(ids_TK=ids_TK, weights_TK=w_TK.to(z_TE.dtype))
    scores_TE = scores_from_logits(z_TE, scoring)
    valid_TK = ids_TK >= 0
    w_TK = torch.where(valid_TK, scores_TE.gather(1, ids_TK.clamp(min=0)), torch.zeros((), dtype=scores_TE.dtype))
    key_TK = torch.where(valid_TK, w_TK, torch.full((), -1.0, dtype=w_TK.dtype))
    order_TK = torch.sort(key_TK, dim=1, descending=True, stable=True).indices
    w_TK = w_TK.gather(1, order_TK)
    ids_TK = ids_TK.gather(1, order_TK)
    if renormalize:
        w_TK = w_TK / w_TK.sum(dim=1, keepdim=True).clamp_min(torch.finfo(w_TK.dtype).tiny)
    return Selection(ids_TK=ids_TK, weights_TK=w_TK.to(z_TE.dtype))


def _rank_order(z_TE: torch.Tensor) -> torch.Tensor:
    """order_TE[t, r] = the expert with rank r (0 = highest logit). Stable: ties keep lower id first."""
    return torch.sort(z_TE, dim=1, descending=True, stable=True).indices


# ---------------------------------------------------------------------------------------------
# rank functions of the residency-free policies: (z_TE, k, hyper-parameters) -> ids_TK


def topk_rank(z_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Original routing: the K experts with the highest logits."""
    check_logits(z_TE, k)
    # Stable sort, not torch.topk: ties (common with float16/bf16 logits) must break exactly as in the
    # other policies (lower id first), or a zero-strength policy would not reproduce the original routing.
    return _rank_order(z_TE)[:, :k]


def prune_rank(z_TE: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """Pruning baseline (001 Sec. 4.2): keep the experts ranked < h, drop ranks ≥ h (slots padded with -1).

    ``1 ≤ h ≤ K``; h = K is the original top-K. The miss rate of this policy is normalised by K, not h.
    """
    check_logits(z_TE, k)
    if not 1 <= h <= k:
        raise ValueError(f"prune h must be in [1, K={k}], got h={h}")
    ids_TK = _rank_order(z_TE)[:, :k].clone()
    ids_TK[:, h:] = -1
    return ids_TK


@dataclass
class DeltaAvg:
    """Per-layer estimate of Δavg = E_x E_t [max(z) - min(z)] (001 Eq. 10).

    Either a fixed value (from a calibration pass) or a running average over every token seen (``update``,
    or the policy kernel as it ranks: float32 spreads accumulated token by token in float64). ``value`` is
    the current estimate (0 before any update).
    """

    fixed: float | None = None
    total: float = 0.0
    count: int = 0

    def update(self, z_TE: torch.Tensor) -> None:
        if self.fixed is None:
            lo_T, hi_T = torch.aminmax(z_TE.float(), dim=1)
            for spread in (hi_T - lo_T).tolist():
                self.total += spread
                self.count += 1

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return self.total / self.count if self.count else 0.0

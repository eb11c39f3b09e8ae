"""Cache-aware routing policies: pure, batched functions of router logits and a residency mask.

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
    "max_rank_rank",
    "cumsum_threshold_rank",
    "cache_prior_rank",
    "eras_threshold_rank",
    "eras_bias_rank",
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


def _check(z_TE: torch.Tensor, k: int, resident: torch.Tensor | None = None) -> None:
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


def _mask_TE(resident: torch.Tensor, z_TE: torch.Tensor) -> torch.Tensor:
    return resident.to(z_TE.device).expand_as(z_TE)


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_j(j: int, k: int) -> None:
    if not 0 <= j <= k:
        raise ValueError(f"top-J must be in [0, K={k}], got J={j}")


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


def _promote_select(order_TE: torch.Tensor, resident_TE: torch.Tensor, m_T: torch.Tensor, j: int, k: int) -> torch.Tensor:
    """Select the first K experts of promote(r[:J]; promote(r[:M] ∩ C; r)) (001 Eq. 7), batched.

    The promoted ranking sorts experts by (group, original rank) with group 0 = top-J, group 1 = resident
    and ranked below M (excluding top-J), group 2 = the rest; within a group the original order is kept,
    which is exactly what the two promote operations of Algorithm 1 produce.
    """
    t, e = order_TE.shape
    rank_R = torch.arange(e, device=order_TE.device)  # rank positions 0..E-1
    resident_sorted_TE = resident_TE.gather(1, order_TE)  # residency of the expert at each rank
    in_top_m_TE = rank_R.unsqueeze(0) < m_T.unsqueeze(1)
    group_TE = torch.full((t, e), 2, dtype=torch.long, device=order_TE.device)
    group_TE = torch.where(in_top_m_TE & resident_sorted_TE, torch.ones_like(group_TE), group_TE)
    group_TE[:, :j] = 0
    key_TE = group_TE * e + rank_R.unsqueeze(0)
    pos_TK = torch.topk(key_TE, k, dim=1, largest=False, sorted=True).indices
    return order_TE.gather(1, pos_TK)


def _with_top_j(resident_TE: torch.Tensor, z_TE: torch.Tensor, j: int) -> torch.Tensor:
    """The residency mask with the top-J experts of each token added (001 Sec. 3.3, m̃_t)."""
    if j == 0:
        return resident_TE
    return resident_TE.scatter(1, torch.topk(z_TE, j, dim=1).indices, True)


def _rerank_topk(score_TE: torch.Tensor, z_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Top-K of modified scores with ties broken by the original ranking (then by id).

    Re-ranking can create ties the logits do not have (float rounding of z + c, softmax underflow); they
    must resolve in the original order, so that a uniform boost (every expert resident) or a zero
    strength selects exactly the original top-K.
    """
    order_TE = _rank_order(z_TE)
    pos_TK = torch.sort(score_TE.gather(1, order_TE), dim=1, descending=True, stable=True).indices[:, :k]
    return order_TE.gather(1, pos_TK)


def _per_row(value: float | torch.Tensor, z_TE: torch.Tensor) -> float | torch.Tensor:
    """A scalar hyper-parameter, or a [T] tensor broadcast over experts (one value per row)."""
    if isinstance(value, torch.Tensor):
        return value.to(z_TE.device, torch.float32).reshape(-1, 1)
    return float(value)


# ---------------------------------------------------------------------------------------------
# rank functions: (z_TE, resident, k, hyper-parameters) -> ids_TK (unordered set per row)


def topk_rank(z_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Original routing: the K experts with the highest logits."""
    _check(z_TE, k)
    # Stable sort, not torch.topk: ties (common with float16/bf16 logits) must break exactly as in the
    # other policies (lower id first), or a zero-strength policy would not reproduce the original routing.
    return _rank_order(z_TE)[:, :k]


def prune_rank(z_TE: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """Pruning baseline (001 Sec. 4.2): keep the experts ranked < h, drop ranks ≥ h (slots padded with -1).

    ``1 ≤ h ≤ K``; h = K is the original top-K. The miss rate of this policy is normalised by K, not h.
    """
    _check(z_TE, k)
    if not 1 <= h <= k:
        raise ValueError(f"prune h must be in [1, K={k}], got h={h}")
    ids_TK = _rank_order(z_TE)[:, :k].clone()
    ids_TK[:, h:] = -1
    return ids_TK


def max_rank_rank(z_TE: torch.Tensor, resident: torch.Tensor, k: int, m: int, j: int = 1) -> torch.Tensor:
    """Max-Rank (001 Algorithm 1): promote resident experts ranked < M, then always keep the top-J."""
    _check(z_TE, k, resident)
    _check_j(j, k)
    e = z_TE.shape[1]
    if not 0 <= m <= e:
        raise ValueError(f"max-rank M must be in [0, E={e}], got M={m}")
    order_TE = _rank_order(z_TE)
    m_T = torch.full((z_TE.shape[0],), m, dtype=torch.long, device=z_TE.device)
    return _promote_select(order_TE, _mask_TE(resident, z_TE), m_T, j, k)


def cumsum_threshold_rank(
    z_TE: torch.Tensor,
    resident: torch.Tensor,
    k: int,
    p: float,
    j: int = 1,
    *,
    scoring: str = "softmax",
) -> torch.Tensor:
    """Cumulative-probability threshold (001 Algorithm 2 / Eq. 8): per token, M is the smallest number of
    top-ranked experts whose probabilities sum to ≥ p (M = 0 for p = 0), then Max-Rank with that M."""
    _check(z_TE, k, resident)
    _check_j(j, k)
    _check_unit("cumsum threshold p", p)
    order_TE = _rank_order(z_TE)
    probs_sorted_TE = scores_from_logits(z_TE, scoring).gather(1, order_TE)
    cum_TE = probs_sorted_TE.cumsum(dim=1)
    # Algorithm 2: while p_cum < p: M += 1 -> M = 1 + #{i : cum_i < p} when p > 0, else 0.
    m_T = (cum_TE < p).sum(dim=1) + (1 if p > 0 else 0)
    m_T = m_T.clamp(max=z_TE.shape[1])
    return _promote_select(order_TE, _mask_TE(resident, z_TE), m_T, j, k)


@dataclass
class DeltaAvg:
    """Per-layer estimate of Δavg = E_x E_t [max(z) - min(z)] (001 Eq. 10).

    Either a fixed value (from a calibration pass) or a running average updated with every batch of
    logits seen (``update``). ``value`` is the current estimate (0 before any update).
    """

    fixed: float | None = None
    total: float = 0.0
    count: int = 0

    def update(self, z_TE: torch.Tensor) -> None:
        if self.fixed is None:
            lo_T, hi_T = torch.aminmax(z_TE, dim=1)
            self.total += float((hi_T - lo_T).sum())
            self.count += int(lo_T.numel())

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return self.total / self.count if self.count else 0.0


def cache_prior_rank(
    z_TE: torch.Tensor,
    resident: torch.Tensor,
    k: int,
    lam: float,
    j: int = 1,
    *,
    delta: float | torch.Tensor | DeltaAvg,
) -> torch.Tensor:
    """Cache-Prior (001 Eq. 9-10): z' = z + λ·Δavg·m̃ with m̃ the residency mask plus the top-J experts;
    select the top-K of z'.

    ``delta`` is Δavg as a number, a [T] tensor (one value per row, e.g. rows = layers of one token), or a
    :class:`DeltaAvg` (which this call updates with ``z_TE`` first, so a running average includes the
    current tokens).
    """
    _check(z_TE, k, resident)
    _check_j(j, k)
    _check_unit("cache-prior λ", lam)
    if isinstance(delta, DeltaAvg):
        delta.update(z_TE)
        delta = delta.value
    mask_TE = _with_top_j(_mask_TE(resident, z_TE), z_TE, j)
    boost = _per_row(delta, z_TE) * lam
    if isinstance(boost, float):
        boosted_TE = torch.add(z_TE.float(), mask_TE.float(), alpha=boost)
    else:
        boosted_TE = torch.addcmul(z_TE.float(), mask_TE.float(), boost)
    return _rerank_topk(boosted_TE, z_TE, k)


def eras_threshold_rank(
    z_TE: torch.Tensor,
    resident: torch.Tensor,
    k: int,
    alpha: float,
    j: int = 0,
    *,
    scoring: str = "softmax",
) -> torch.Tensor:
    """ERAS thresholding (003 III-B-1): add α to the router probabilities of resident experts, take top-K.

    Optional top-J guarantee (not in 003; J = 0 reproduces the paper).
    """
    _check(z_TE, k, resident)
    _check_j(j, k)
    if alpha < 0:
        raise ValueError(f"ERAS α must be ≥ 0, got {alpha}")
    mask_TE = _with_top_j(_mask_TE(resident, z_TE), z_TE, j)
    scores_TE = scores_from_logits(z_TE, scoring)
    return _rerank_topk(torch.where(mask_TE, scores_TE + alpha, scores_TE), z_TE, k)


def eras_bias_rank(
    z_TE: torch.Tensor,
    resident: torch.Tensor,
    k: int,
    beta: float,
    freq_E: torch.Tensor,
    j: int = 0,
) -> torch.Tensor:
    """ERAS biasing (003 III-B-2): subtract β·(1 - freq_i) from the logits of non-resident experts, take
    top-K. ``freq_E`` is the layer's normalised activation frequency profile (see ``expertcache.sim``)."""
    _check(z_TE, k, resident)
    _check_j(j, k)
    if beta < 0:
        raise ValueError(f"ERAS β must be ≥ 0, got {beta}")
    e = z_TE.shape[1]
    if freq_E.shape not in ((e,), tuple(z_TE.shape)):
        raise ValueError(f"ERAS frequency profile must be [E]={e} or [T, E], got {tuple(freq_E.shape)}")
    mask_TE = _with_top_j(_mask_TE(resident, z_TE), z_TE, j)
    penalty = beta * (1.0 - freq_E.float().to(z_TE.device))
    z = z_TE.float()
    return _rerank_topk(torch.where(mask_TE, z, z - penalty), z_TE, k)

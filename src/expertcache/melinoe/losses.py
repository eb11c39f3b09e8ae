"""MELINOE's fine-tuning losses (004 Sec. 3.1.1, Eq. 4-6; Appendix C).

Shapes: ``p`` router probabilities ``[B, L, T, E]`` (batch, MoE layer, token, expert), softmax over E.

**Request vector and how the gradient reaches the router.** 004 defines r^(ℓ,t) as the binary Top-K mask of
p^(ℓ,t); a mask has no gradient. Two estimators are offered (``request=``):

- ``"st"`` (default) -- straight-through: ``r = mask + (p - stopgrad(p))``. Its *value* is exactly 004's binary
  request vector (so the loss value is Eq. 4 to the bit), its gradient is that of p: ∂L/∂p_i =
  ∂L/∂r_i for every expert, selected or not. The router is pushed towards experts with a high soft cache
  state (1 - c_i small) and towards experts that later tokens request (through c of later tokens);
- ``"masked"`` -- ``r = mask ⊙ p``: only the selected experts' probabilities carry gradient (values < 1, so
  the loss value is no longer Eq. 4's miss count).

Either way p = softmax(h W_routerᵀ), so ∂L_cs/∂W_router ≠ 0 (tested).

**Soft cache state** (Eq. 3 and Appendix C Prop. C.3): Count^(1) = 0 (``start="fill"``: the cache-fill phase)
or C/E·1 (``start="uniform"``: ‖Count‖₁ = C, no fill phase); Count^(t+1) = γ Count^(t) + r^(t); the state the
token t sees is c^(t) = Count^(t) / Z^(t) with Z^(t) = max(1, ‖Count^(t)‖₁ / C) in the fill mode (‖c‖₁ grows
until it reaches C, then stays at C -- the same Z recursion Z^(t+1) = γ Z^(t) + K/C as 004 once it starts)
and Z^(t) = ‖Count^(t)‖₁ / C in the uniform mode (Prop. C.3). Z is computed from the values (the binary ‖r‖₁ =
K) and treated as a constant.

L_cs = 1/(L T) Σ_ℓ Σ_t ⟨r^(ℓ,t), 1 - c^(ℓ,t)⟩ (Eq. 4), averaged over the batch.

L_rm = 1/(L T) Σ_ℓ Σ_t Σ_{i,j} 1{p_b,i > p_b,j} [ρ - (p_f,i - p_f,j)]_+ (Eq. 5, 12), averaged over the batch;
p_b is the base model's own router distribution on the same tokens (a frozen copy's forward; no gradient).
"""

from __future__ import annotations

import torch

__all__ = ["request_vector", "soft_cache_states", "cache_sim_loss", "rank_match_loss", "hard_misses"]


def request_vector(p: torch.Tensor, k: int, mode: str = "st") -> torch.Tensor:
    """r from router probabilities ``p [..., E]``: the Top-K mask (value) with the gradient path of ``mode``."""
    if mode not in ("st", "masked"):
        raise ValueError(f"request estimator must be 'st' or 'masked', got {mode!r}")
    idx = p.detach().topk(k, dim=-1).indices
    mask = torch.zeros_like(p).scatter_(-1, idx, 1.0)
    if mode == "st":
        return mask + (p - p.detach())  # exactly the mask in value (p - p = 0), the gradient of p
    return mask * p


def soft_cache_states(r: torch.Tensor, capacity: int, gamma: float, start: str = "fill") -> torch.Tensor:
    """c^(t) for every token: ``r [B, L, T, E]`` -> ``c [B, L, T, E]`` (the state *before* token t's request)."""
    if start not in ("fill", "uniform"):
        raise ValueError(f"cache start must be 'fill' or 'uniform', got {start!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"γ must be in [0, 1], got {gamma}")
    b, l, t, e = r.shape
    if start == "fill":
        count = r.new_zeros(b, l, e)
    else:
        count = r.new_full((b, l, e), capacity / e)
    states = []
    for i in range(t):
        norm = count.detach().sum(-1, keepdim=True)
        if start == "fill":
            z = torch.clamp(norm / capacity, min=1.0)
        else:
            z = norm / capacity
        states.append(count / z)
        count = gamma * count + r[:, :, i]
    return torch.stack(states, dim=2)


def cache_sim_loss(p: torch.Tensor, k: int, capacity: int, gamma: float = 0.9, *, start: str = "fill",
                   request: str = "st") -> torch.Tensor:
    """L_cs (Eq. 4) of router probabilities ``p [B, L, T, E]``; a scalar."""
    r = request_vector(p, k, request)
    c = soft_cache_states(r, capacity, gamma, start)
    return (r * (1.0 - c)).sum(-1).mean()


def rank_match_loss(p_f: torch.Tensor, p_b: torch.Tensor, rho: float = 0.1) -> torch.Tensor:
    """L_rm (Eq. 5) of fine-tuned ``p_f`` against base ``p_b`` (both ``[..., E]``); a scalar (mean over the
    leading positions of the per-position sum over ordered pairs)."""
    p_b = p_b.detach()
    before = (p_b.unsqueeze(-1) > p_b.unsqueeze(-2)).to(p_f.dtype)  # [..., i, j]: base prefers i over j
    gap = p_f.unsqueeze(-1) - p_f.unsqueeze(-2)  # p_f,i - p_f,j
    m = (before * torch.relu(rho - gap)).sum((-1, -2))
    return m.mean()


def hard_misses(p: torch.Tensor, k: int, capacity: int, gamma: float = 0.9) -> float:
    """Misses per token per layer of the hard γ cache (004 Def. C.1, App. C Eq. 10) on the Top-K requests of
    ``p [B, L, T, E]`` -- the quantity L_cs relaxes; for logging."""
    from expertcache.cache.discounted import DiscountedCache

    ids = p.detach().topk(k, dim=-1).indices.cpu().tolist()
    b, l, t, e = p.shape
    misses = 0
    for bi in range(b):
        for li in range(l):
            cache = DiscountedCache(e, capacity, gamma=gamma)
            cache.serve(ids[bi][li])
            misses += cache.stats.misses
    return misses / (b * l * t)

"""Cache-aware routing: each policy once, as a kernel (``kernels``), run by :class:`Router` (``config``: the
configuration and per-layer state); top-K, pruning, weights and Δavg in torch (``policies``)."""

from expertcache.routing.config import POLICIES, STRENGTH, Router, RoutingConfig
from expertcache.routing.registry import PolicySpec, policies, register_policy, registered_policy, unregister_policy
from expertcache.routing.policies import (
    DeltaAvg,
    Selection,
    prune_rank,
    scores_from_logits,
    topk_rank,
    weights_for,
)

__all__ = [
    "POLICIES", "STRENGTH", "PolicySpec", "Router", "RoutingConfig", "DeltaAvg", "Selection", "policies",
    "register_policy", "registered_policy", "unregister_policy",
    "prune_rank", "scores_from_logits", "topk_rank", "weights_for",
]

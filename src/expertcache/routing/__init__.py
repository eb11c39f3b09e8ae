"""Cache-aware routing: each policy once, as a kernel (``kernels``); batched torch entry points (``policies``);
configuration and per-layer state (``config``)."""

from expertcache.routing.config import POLICIES, STRENGTH, Router, RoutingConfig
from expertcache.routing.policies import (
    DeltaAvg,
    Selection,
    cache_prior_rank,
    cumsum_threshold_rank,
    eras_bias_rank,
    eras_threshold_rank,
    max_rank_rank,
    prune_rank,
    scores_from_logits,
    topk_rank,
    weights_for,
)

__all__ = [
    "POLICIES", "STRENGTH", "Router", "RoutingConfig", "DeltaAvg", "Selection",
    "cache_prior_rank", "cumsum_threshold_rank", "eras_bias_rank", "eras_threshold_rank",
    "max_rank_rank", "prune_rank", "scores_from_logits", "topk_rank", "weights_for",
]

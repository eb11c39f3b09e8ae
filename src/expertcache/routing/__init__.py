"""Cache-aware routing: each policy once, as a kernel (``kernels``); batched torch entry points (``policies``);
configuration (``config``) and per-layer state (``router``)."""

from expertcache.routing.config import POLICIES, STRENGTH, RoutingConfig
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
from expertcache.routing.router import RankKeys, Router

__all__ = [
    "RankKeys",
    "POLICIES", "STRENGTH", "Router", "RoutingConfig", "DeltaAvg", "Selection",
    "cache_prior_rank", "cumsum_threshold_rank", "eras_bias_rank", "eras_threshold_rank",
    "max_rank_rank", "prune_rank", "scores_from_logits", "topk_rank", "weights_for",
]

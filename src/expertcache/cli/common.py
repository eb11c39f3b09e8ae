"""Argument groups shared by sub-commands, generated from the config dataclasses (defaults live there)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from expertcache.cache import EVICTION_POLICIES
from expertcache.routing import POLICIES, RoutingConfig

_HELP = {
    "policy": "routing policy",
    "top_j": "always keep the original top-J experts (001 uses 1)",
    "h": "prune: keep ranks < h (default K)",
    "m": "max-rank: promote resident experts ranked < M",
    "p": "cumsum: cumulative-probability threshold in [0, 1]",
    "lam": "cache-prior: strength λ in [0, 1]",
    "delta": "cache-prior: fixed Δavg (default: running average of max(z)-min(z) per layer)",
    "alpha": "eras-threshold: α added to resident experts' probabilities",
    "beta": "eras-bias: β scale of the penalty on non-resident experts",
}


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    """--policy, --top-j, --h, --m, --p, --lam, --delta, --alpha, --beta (from RoutingConfig)."""
    g = parser.add_argument_group("routing policy")
    for f in fields(RoutingConfig):
        flag = "--" + f.name.replace("_", "-")
        kw = dict(dest=f"routing_{f.name}", default=f.default, help=f"{_HELP[f.name]} (default: {f.default})")
        if f.name == "policy":
            g.add_argument(flag, choices=POLICIES, **kw)
        elif f.name in ("top_j", "h", "m"):
            g.add_argument(flag, type=int, **kw)
        else:
            g.add_argument(flag, type=float, **kw)


def routing_from_args(args: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(**{f.name: getattr(args, f"routing_{f.name}") for f in fields(RoutingConfig)})


def add_cache_args(parser: argparse.ArgumentParser, *, default_capacity: str = "0.5") -> None:
    g = parser.add_argument_group("expert cache")
    g.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru",
                   help="eviction policy (default: lru; gamma: 004 Def. C.1, resident = Top-C of γ-discounted "
                   "counts, a low-count miss is a transient load; gamma-admit: discounted counts, always admits)")
    g.add_argument("--capacity", default=default_capacity,
                   help=f"experts per layer in fast memory: a count (16) or a fraction of N (0.5) "
                        f"(default: {default_capacity})")
    add_cache_state_args(g)


def add_cache_state_args(g) -> None:
    """--gamma, --initial, --seed, --between-sequences: the cache options besides eviction and capacity."""
    g.add_argument("--gamma", type=float, default=0.9, help="γ of the gamma / gamma-admit cache (1 = LFU, 0 = LRU; default 0.9)")
    g.add_argument("--initial", default="empty", choices=("empty", "random"), help="initial cache state")
    g.add_argument("--seed", type=int, default=0, help="seed for a random initial state")
    g.add_argument("--between-sequences", choices=("carry", "reset"), default="carry",
                   help="keep caches across sequences (carry) or start each sequence empty (reset)")


def add_predictor_arg(parser) -> None:
    """--predictor PATH (MELINOE, 004): prefetch the predicted Top-C experts per layer before decoding."""
    parser.add_argument("--predictor", default=None, metavar="PATH",
                        help="MELINOE expert-activation predictor (from `expertcache melinoe predictor`): load the "
                             "Top-C predicted experts of every layer before decoding (a batch pools its rows); "
                             "prefetch loads are counted apart from misses")


def predictor_from_args(args):
    """The loaded predictor of ``--predictor`` (checked before any long work), or None."""
    if not getattr(args, "predictor", None):
        return None
    from expertcache.melinoe.predictor import Predictor

    return Predictor.load(args.predictor)

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
    g.add_argument("--eviction", choices=EVICTION_POLICIES, default="lru", help="eviction policy (default: lru)")
    g.add_argument("--capacity", default=default_capacity,
                   help=f"experts per layer in fast memory: a count (16) or a fraction of N (0.5) "
                        f"(default: {default_capacity})")
    add_cache_state_args(g)


def add_cache_state_args(g) -> None:
    """--gamma, --initial, --seed, --between-sequences: the cache options besides eviction and capacity."""
    g.add_argument("--gamma", type=float, default=0.9, help="γ of the gamma cache (1 = LFU, 0 = LRU; default 0.9)")
    g.add_argument("--initial", default="empty", choices=("empty", "random"), help="initial cache state")
    g.add_argument("--seed", type=int, default=0, help="seed for a random initial state")
    g.add_argument("--between-sequences", choices=("carry", "reset"), default="carry",
                   help="keep caches across sequences (carry) or start each sequence empty (reset)")


# -- torch CPU threads (every command that runs a model) ------------------------------------------

#: below this hidden size a model's per-token ops are tiny ([1, D] × [D, F]): one thread is fastest, and
#: any extra thread only spins -- on a busy 2-core VM torch's default 2 threads made a [1,144]×[144,576]
#: linear ~1000× slower (18 ms vs 20 µs) and `generate` 20-60× slower (issue 10).
SMALL_HIDDEN = 1024


def default_threads(hidden_size: int | None = None, cores: int | None = None) -> int:
    """The ``--threads auto`` rule: 1 for small models (hidden < ``SMALL_HIDDEN`` or unknown) and on
    machines with at most 2 cores; otherwise half the cores (a decode step's matmuls are [1, D] × [D, F]:
    more threads than that contend with the reader threads and anything else running), at most 8."""
    import os

    cores = cores or os.cpu_count() or 1
    if hidden_size is None or hidden_size < SMALL_HIDDEN or cores <= 2:
        return 1
    return max(1, min(8, cores // 2))


def add_threads_arg(parser) -> None:
    """``--threads N|auto`` (default auto, see :func:`default_threads`)."""
    parser.add_argument("--threads", default="auto", type=_threads_type,
                        help="torch CPU threads: a number, or auto (default) = 1 for models with hidden size "
                             f"< {SMALL_HIDDEN} or on machines with <= 2 cores, else half the cores (max 8)")


def _threads_type(text: str):
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads must be a positive number or 'auto', got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--threads must be >= 1, got {n}")
    return n


def apply_threads(args: argparse.Namespace, model=None) -> int:
    """Set torch's CPU threads from ``args.threads`` (``auto``: :func:`default_threads` of ``model``'s hidden
    size -- a checkpoint folder, a config or a model; None = small). Returns the count set."""
    import torch

    n = getattr(args, "threads", "auto")
    if n in (None, "auto"):
        n = default_threads(_hidden_size(model))
    torch.set_num_threads(int(n))
    args.threads = int(n)
    return int(n)


def _hidden_size(model) -> int | None:
    if model is None:
        return None
    import json
    from pathlib import Path

    if isinstance(model, (str, Path)):
        try:
            return int(json.loads((Path(model) / "config.json").read_text()).get("hidden_size"))
        except (OSError, ValueError, TypeError):
            return None
    cfg = getattr(model, "config", model)
    return getattr(cfg, "hidden_size", None)

"""Benchmark of the core library: simulator throughput per eviction policy and routing-policy call cost.

Usage:  python benchmarks/bench_core.py [--tokens 100000] [--layers 16] [--experts 64] [--top-k 8]
                                        [--repeats 5] [--out benchmarks/results/core.jsonl]

Selections are drawn from a skewed (Zipf-like) per-layer expert popularity with a little temporal
locality, so hit rates resemble real traces rather than uniform noise. Reports medians over repeats,
as a table and as JSONL rows (results as data).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import numpy as np
import torch

from expertcache import __version__
from expertcache.cache import make_cache
from expertcache.results import append_jsonl
from expertcache.routing import Router, RoutingConfig


def synthetic_selections(t: int, l: int, e: int, k: int, seed: int = 0) -> np.ndarray:
    """[T, L, K] distinct ids per row: Gumbel-top-k over skewed logits with a slowly drifting bias."""
    rng = np.random.default_rng(seed)
    base = -np.log(np.arange(1, e + 1))[None, :] * 0.8  # Zipf-like popularity
    perm = np.stack([rng.permutation(e) for _ in range(l)])  # each layer its own favourites
    ids = np.empty((t, l, k), dtype=np.int64)
    chunk = 2048
    drift = np.zeros((l, e))
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        drift = 0.9 * drift + 0.3 * rng.normal(size=(l, e))
        z = base[:, perm].reshape(1, l, e) + drift[None] + rng.gumbel(size=(b - a, l, e))
        ids[a:b] = np.argpartition(-z, k - 1, axis=-1)[..., :k]
    return ids


def bench_cache(ids: np.ndarray, e: int, capacity: int, kind: str, repeats: int) -> dict:
    steps_by_layer = [ids[:, layer, :].tolist() for layer in range(ids.shape[1])]
    accesses = ids.size
    times, misses = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        total = 0
        if kind == "lru-sim":  # expertcache.sim.replay on the [T, L, K] array: compiled LRU loop with numba
            from expertcache.sim import replay

            total = replay(ids, e, capacity, eviction="lru").overall.misses
            times.append(time.perf_counter() - t0)
            misses = total
            continue
        for steps in steps_by_layer:
            cache = make_cache(kind, e, capacity, future=steps if kind == "belady" else None)
            total += cache.replay(steps).misses
        times.append(time.perf_counter() - t0)
        misses = total
    med = statistics.median(times)
    return {"bench": "simulator", "eviction": kind, "accesses": accesses, "median_s": med,
            "accesses_per_s": accesses / med, "miss_rate": misses / accesses, "runs_s": times}


def bench_policy(cfg: RoutingConfig, e: int, k: int, repeats: int, calls: int = 2000) -> dict:
    torch.manual_seed(0)
    z = torch.randn(1, e)
    mask = torch.rand(e) < 0.5
    freq = torch.full((1, e), 1.0 / e)
    router = Router(cfg, e, k, renormalize=True, freq_LE=freq)
    for _ in range(200):
        router.route(0, z, mask)
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            router.route(0, z, mask)
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return {"bench": "policy_call", "policy": cfg.label(), "shape": [1, e], "k": k,
            "median_us": statistics.median(per_call), "runs_us": per_call}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=None, help="default N/2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    torch.set_num_threads(1)
    e, k = args.experts, args.top_k
    cap = args.capacity or e // 2
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch thread, python {platform.python_version()}, torch {torch.__version__}"
    print(f"expertcache {__version__} core benchmark; {machine}")
    ids = synthetic_selections(args.tokens, args.layers, e, k)
    print(f"trace: {args.tokens} tokens x {args.layers} layers x top-{k} of {e} = {ids.size / 1e6:.1f} M accesses; C={cap}")
    rows = []
    for kind in ("lru", "lru-sim", "belady", "gamma", "lfu"):
        r = bench_cache(ids, e, cap, kind, args.repeats if kind in ("lru", "lru-sim", "belady") else 1)
        rows.append(r)
        print(f"  {kind:7s} {r['accesses_per_s'] / 1e6:6.2f} M accesses/s   (median {r['median_s']:.2f} s, "
              f"miss rate {100 * r['miss_rate']:.1f}%)")
    policies = [RoutingConfig(), RoutingConfig("prune", h=k // 2), RoutingConfig("max-rank", m=2 * k),
                RoutingConfig("cumsum", p=0.9), RoutingConfig("cache-prior", lam=0.5),
                RoutingConfig("cache-prior", lam=0.5, delta=2.0), RoutingConfig("eras-threshold", alpha=0.1),
                RoutingConfig("eras-bias", beta=1.0)]
    print(f"policy call on [1, {e}] logits, K={k} (route = rank + weights), median of {args.repeats} x 2000 calls:")
    for cfg in policies:
        r = bench_policy(cfg, e, k, args.repeats)
        rows.append(r)
        print(f"  {cfg.label():38s} {r['median_us']:7.1f} us")
    if args.out:
        for r in rows:
            append_jsonl(args.out, {**r, "version": __version__, "machine": machine, "tokens": args.tokens,
                                    "layers": args.layers, "experts": e, "top_k": k, "capacity": cap})
    return 0


if __name__ == "__main__":
    sys.exit(main())

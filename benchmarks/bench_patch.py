"""Forward time of the stock vs the patched model (BENCHMARKS.md, "Overhead of the routing patch").

Usage:  python benchmarks/bench_patch.py [--seq 128] [--repeats 15] [--mode prefill|decode|both]
                                         [--archs olmoe,mixtral,...] [--no-granular] [--out rows.jsonl]

For every tiny model (``expertcache.models.tiny``, one per supported family) and the shipped ``granular``
model (batch 1, ``torch.no_grad``, 1 torch thread), two timings: ``prefill`` -- one forward pass over
``--seq`` tokens; ``decode`` -- the mean time of one decoding step (a one-token forward with the KV cache),
after an untimed 8-token prompt. Each is measured in three variants:

- ``stock``      -- the unpatched model;
- ``original``   -- patched with the original top-K policy and a live LRU cache of C = N/2 per layer
                    (every token is served by the cache; record off);
- ``cache-prior``-- patched with Cache-Prior λ = 0.5 (J = 1), same cache.

The variants are interleaved within each repeat (order rotated every repeat) so that load from other
processes hits them alike; a fresh patch (fresh caches) is installed before and removed after each timed
call, outside the timing. Each call records wall-clock and thread CPU time (``time.thread_time``; with one
torch thread all compute runs on the calling thread, so CPU time is not inflated by waiting for a core on
a shared machine). Reports the median thread-CPU time per variant and the ratios of medians (targets from
the project: original ≤ 1.10 × stock; cache-prior ≤ 1.10 × original). ``--profile MODEL`` runs cProfile on
the three variants of one model (``--mode decode`` for decoding steps, else prefill) and prints the top
functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time

import torch

from expertcache import __version__
from expertcache.results import append_jsonl
from expertcache.routing import RoutingConfig

VARIANTS = {
    "stock": None,
    "original": RoutingConfig("original"),
    "cache-prior": RoutingConfig("cache-prior", lam=0.5, top_j=1),
}
#: --python-loops adds this variant name; since the kernels have one source (compiled or not at import, see
#: expertcache.compiled), it equals 'cache-prior' in-process: run the benchmark with EXPERTCACHE_NO_NUMBA=1 instead.
TORCH_ROUTER = "cache-prior-python"
_SWITCHES = ()


class _variant:
    """Context manager: patch ``model`` for variant ``name`` (nothing for 'stock'), unpatch on exit."""

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    def __enter__(self):
        import importlib

        from expertcache.models import patch_model

        self.saved = None
        if self.name == TORCH_ROUTER:  # every compiled path off (their AVAILABLE flags)
            self.saved = [(mod, mod.AVAILABLE) for mod in map(importlib.import_module, _SWITCHES)]
            for mod, _ in self.saved:
                mod.AVAILABLE = False
        routing = VARIANTS[self.name if self.name != TORCH_ROUTER else "cache-prior"]
        self.patch = None if routing is None else patch_model(self.model, routing, eviction="lru", capacity=0.5)
        return self

    def __exit__(self, *exc):
        if self.patch is not None:
            self.patch.unpatch()
        for mod, value in self.saved or ():
            mod.AVAILABLE = value


def load(name: str):
    """(model, sequence length cap) of a tiny arch, 'granular' (the shipped model, bf16 -> float32) or a checkpoint
    path (anything with a '/', loaded in float32)."""
    if name == "granular":
        from expertcache.assets import shipped_model_dir
        from expertcache.models import load_model

        model = load_model(shipped_model_dir("granular"))
    elif "/" in name:  # a checkpoint folder, e.g. a realistic-size model from `expertcache bench --make-model`
        from expertcache.models import load_model

        model = load_model(os.path.expanduser(name))
    else:
        from expertcache.models.tiny import build_tiny

        model = build_tiny(name)
    return model, int(model.config.max_position_embeddings)


def _served(v: "_variant") -> None:
    """Read the caches (inside the timing): the patch serves residency-independent selections lazily, on the
    first read, so this makes every variant pay for all of its cache bookkeeping."""
    if v.patch is not None:
        v.patch.caches


def timed_forward(model, x, variant: str) -> tuple[float, float]:
    """(wall, thread CPU) seconds of one forward of ``x``, cache bookkeeping included."""
    with _variant(model, variant) as v, torch.no_grad():
        t0, c0 = time.perf_counter(), time.thread_time()
        model(x)
        _served(v)
        return time.perf_counter() - t0, time.thread_time() - c0


def timed_decode(model, x, variant: str, prompt: int = 8) -> tuple[float, float]:
    """(wall, thread CPU) mean seconds per decoding step: one-token forwards with the KV cache after a ``prompt``-token
    prefill (untimed), for the remaining tokens of ``x``."""
    with _variant(model, variant) as v, torch.no_grad():
        past = model(x[:, :prompt], use_cache=True).past_key_values
        _served(v)
        steps = x.shape[1] - prompt
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(prompt, x.shape[1]):
            past = model(x[:, i:i + 1], past_key_values=past, use_cache=True).past_key_values
        _served(v)
        return (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps


def bench_model(name: str, seq: int, repeats: int, warmup: int = 2, mode: str = "prefill",
                torch_router: bool = False) -> dict:
    model, max_pos = load(name)
    s = min(seq, max_pos)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, model.config.vocab_size, (1, s), generator=g)
    timed = timed_forward if mode == "prefill" else timed_decode
    names = list(VARIANTS) + ([TORCH_ROUTER] if torch_router else [])
    for _ in range(warmup):
        for v in names:
            timed(model, x, v)
    wall: dict[str, list[float]] = {v: [] for v in names}
    cpu: dict[str, list[float]] = {v: [] for v in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for v in order:
            w, c = timed(model, x, v)
            wall[v].append(w)
            cpu[v].append(c)
    med = {v: statistics.median(t) for v, t in cpu.items()}
    med_wall = {v: statistics.median(t) for v, t in wall.items()}
    cfg = model.config
    return {"bench": "patch_forward", "mode": mode, "model": name, "model_type": cfg.model_type, "tokens": s,
            "num_experts": getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
            or getattr(cfg, "n_routed_experts", None),
            "top_k": getattr(cfg, "num_experts_per_tok", None),
            "median_cpu_ms": {v: 1e3 * m for v, m in med.items()},
            "median_wall_ms": {v: 1e3 * m for v, m in med_wall.items()},
            "ratio_original_vs_stock": med["original"] / med["stock"],
            "ratio_cache_prior_vs_original": med["cache-prior"] / med["original"],
            "ratio_cache_prior_vs_stock": med["cache-prior"] / med["stock"],
            "wall_ratio_original_vs_stock": med_wall["original"] / med_wall["stock"],
            "wall_ratio_cache_prior_vs_original": med_wall["cache-prior"] / med_wall["original"],
            "runs_cpu_ms": {v: [1e3 * t for t in ts] for v, ts in cpu.items()},
            "runs_wall_ms": {v: [1e3 * t for t in ts] for v, ts in wall.items()}}


def profile_model(name: str, seq: int, mode: str = "prefill", calls: int = 20, top: int = 18) -> None:
    model, max_pos = load(name)
    x = torch.randint(3, model.config.vocab_size, (1, min(seq, max_pos)))
    timed = timed_forward if mode == "prefill" else timed_decode
    for v in ("stock", "original", "cache-prior"):
        timed(model, x, v)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            timed(model, x, v)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        print(f"\n=== cProfile {name} {v} ({mode}): {calls} runs, sorted by own time ===")
        print("\n".join(buf.getvalue().splitlines()[:top + 12]))


def main(argv=None) -> int:
    from expertcache.models.tiny import TINY_ARCHS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=128, help="tokens per forward (capped at the model's context)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--mode", choices=("prefill", "decode", "both"), default="both",
                    help="prefill: one forward of --seq tokens; decode: per-step time of one-token forwards "
                    "with the KV cache (8-token prompt, then --seq - 8 steps); both (default)")
    ap.add_argument("--archs", default=",".join(TINY_ARCHS), help="comma-separated tiny archs and/or checkpoint paths")
    ap.add_argument("--no-granular", action="store_true", help="skip the shipped granular model")
    ap.add_argument("--python-loops", dest="torch_router", action="store_true",
                    help=f"add the variant {TORCH_ROUTER!r}: Cache-Prior with the compiled (numba) loops off")
    ap.add_argument("--profile", default=None, metavar="MODEL", help="cProfile the patched variants of MODEL")
    ap.add_argument("--out", default=None, help="append JSONL rows here")
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    torch.set_num_threads(1)
    import transformers

    machine = (f"{platform.machine()} {platform.processor() or ''}".strip() + f", 1 torch thread, python "
               f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
    if args.profile:
        profile_model(args.profile, args.seq, "decode" if args.mode == "decode" else "prefill")
        return 0
    names = [a for a in args.archs.split(",") if a] + ([] if args.no_granular else ["granular"])
    print(f"expertcache {__version__} patch benchmark; {machine}")
    modes = ("prefill", "decode") if args.mode == "both" else (args.mode,)
    for mode in modes:
        what = (f"one forward of 1 x {args.seq} tokens" if mode == "prefill" else
                f"one decoding step (1 new token, KV cache; mean over {args.seq} - 8 steps)")
        print(f"\n[{mode}] {what} (capped at context); median thread-CPU time of {args.repeats} interleaved "
              f"repeats (wall-clock ratios last); patched: LRU C=N/2")
        print(f"{'model':22s} {'T':>4} {'stock ms':>9} {'orig ms':>9} {'c-p ms':>9} {'orig/stock':>11} "
              f"{'c-p/orig':>9} {'c-p/stock':>10} {'wall o/s':>9} {'wall c/o':>9}")
        for name in names:
            r = bench_model(name, args.seq, args.repeats, mode=mode, torch_router=args.torch_router)
            m = r["median_cpu_ms"]
            print(f"{name:22s} {r['tokens']:>4} {m['stock']:9.3f} {m['original']:9.3f} {m['cache-prior']:9.3f} "
                  f"{r['ratio_original_vs_stock']:11.2f} {r['ratio_cache_prior_vs_original']:9.2f} "
                  f"{r['ratio_cache_prior_vs_stock']:10.2f} {r['wall_ratio_original_vs_stock']:9.2f} "
                  f"{r['wall_ratio_cache_prior_vs_original']:9.2f}"
                  + (f"   {TORCH_ROUTER}: {m[TORCH_ROUTER]:.3f} ms" if args.torch_router else ""), flush=True)
            if args.out:
                append_jsonl(args.out, {**r, "version": __version__, "machine": machine, "repeats": args.repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())

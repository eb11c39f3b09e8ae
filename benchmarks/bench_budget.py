"""Cost of budget-targeted routing: wall time of the closed-loop held-out stream (granular, C = N/2, 4096 tokens)
under a fixed Cache-Prior λ vs the miss-rate controller (token-by-token routing), interleaved repeats, medians.
Prints a table; with ``--out`` appends one JSONL row per configuration (every run's seconds, the median, the
ratio to the fixed λ, the configuration, package version and machine).

    python benchmarks/bench_budget.py --repeats 5 --out benchmarks/results/budget.jsonl
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default=None, help="append one JSONL row per configuration to this file")
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    if args.repeats < 1 or args.tokens < 512:
        ap.error("--repeats must be >= 1 and --tokens >= 512")
    import torch

    torch.set_num_threads(1)
    from expertcache.eval import load_model_and_tokenizer
    from expertcache.eval.budget import heldout_tokens, stream_eval
    from expertcache.routing import RoutingConfig

    model, tok = load_model_and_tokenizer("granular")
    toks = heldout_tokens(tok, args.tokens)
    runs = {"fixed lambda=0.15": dict(routing=RoutingConfig("cache-prior", lam=0.15)),
            "controller target=0.0264": dict(routing=RoutingConfig("cache-prior"), target=0.0264,
                                             controller_kw=dict(s0=0.149))}
    times = {k: [] for k in runs}
    stream_eval(model, toks[:512], RoutingConfig("cache-prior", lam=0.15), capacity=0.5)  # warm-up (numba)
    for _ in range(args.repeats):
        for name, kw in runs.items():
            t0 = time.perf_counter()
            stream_eval(model, toks, capacity=0.5, **kw)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["fixed lambda=0.15"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:28s} median {med:.2f} s ({args.tokens / med:.0f} tok/s), x{med / base:.2f}; runs "
              + ", ".join(f"{t:.2f}" for t in ts))
        if args.out:
            from expertcache import __version__
            from expertcache.offload.bench import machine_info
            from expertcache.results import append_jsonl

            kw = runs[name]
            append_jsonl(args.out, dict(
                bench="budget", run=name, model="granular", capacity=0.5, tokens=args.tokens, repeats=args.repeats,
                policy=kw["routing"].policy, lam=kw["routing"].lam, target_miss_rate=kw.get("target"),
                controller=kw.get("controller_kw"), runs_s=ts, median_s=med, tok_s=args.tokens / med,
                ratio_to_fixed=med / base, version=__version__, machine=machine_info(),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

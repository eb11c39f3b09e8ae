"""One decode token's MoE step on q4x8 int4 experts, per layer: the per-expert path (``quant.quant_mlp`` per expert,
then step.py's combine: stack, routing weights, adds in x's dtype) against the fused call (offload/q4moe.py) on 1
and on 2 threads. The experts (random weights, packed as the sidecar packs them) lie in one buffer, as in the slot
arena; each step routes to ``--k`` distinct experts of ``--experts`` (a fixed random sequence), so their bytes come
from memory, not the cache, as in a decode. Variants interleaved per round; medians over rounds printed (ms per
layer-step) with ratios to the per-expert path, one JSON line per (variant, round) to ``--out`` if given.

    OMP_NUM_THREADS=2 python benchmarks/bench_fused_moe.py [--d 2048] [--f 1024] [--experts 64] [--k 8]
        [--group 64] [--dtype bf16] [--rounds 7] [--steps 64] [--threads 1,2] [--out rows.jsonl]

Defaults: the 8-layer OLMoE-1B-7B shape (/work/peers/L8). A bad argument is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints its usage too)
        print(f"bench_fused_moe: error: {message}", file=sys.stderr)
        sys.exit(2)


def _args(argv=None):
    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--d", type=int, default=2048)
    p.add_argument("--f", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=64, help="layer-steps timed per variant per round")
    p.add_argument("--threads", default="1,2", help="thread counts of the fused call, comma-separated")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    for name in ("d", "f", "experts", "k", "rounds", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.k > a.experts:
        p.error(f"--k must be <= --experts ({a.experts}), got {a.k}")
    if a.group not in (32, 64, 128, 256):
        p.error(f"--group must be one of 32, 64, 128, 256, got {a.group}")
    try:
        a.threads = [int(t) for t in a.threads.split(",")]
    except ValueError:
        p.error(f"--threads must be comma-separated integers, got {a.threads!r}")
    if not a.threads or min(a.threads) < 1:
        p.error(f"--threads must be >= 1 each, got {a.threads}")
    from expertcache.results import check_rows_out

    check_rows_out(p, a.out)
    return a


def main(argv=None) -> int:
    a = _args(argv)
    import torch
    import torch.nn.functional as F

    from expertcache.offload import q4moe, q4x8
    from expertcache.offload.quant import QuantLayout, pack_expert, quant_mlp

    if not q4x8.available():
        print("bench_fused_moe: error: the q4x8 kernels need numba (not installed, or EXPERTCACHE_NO_NUMBA set)",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dtype = getattr(torch, DTYPES[a.dtype])
    lay = QuantLayout("int4", a.d, a.f, a.group, dtype, kernel=q4x8.KERNEL)
    g = torch.Generator().manual_seed(0)
    arena = torch.empty(a.experts, lay.nbytes, dtype=torch.uint8)
    one = pack_expert(torch.randn(2 * a.f, a.d, generator=g) * 0.02, torch.randn(a.d, a.f, generator=g) * 0.02, lay)
    for e in range(a.experts):  # one packed expert, its codes shuffled per copy (distinct bytes, fast to build)
        arena[e] = one
        codes = lay.views(arena[e])
        for c in (codes[0], codes[2]):
            c.view(-1).copy_(c.view(-1)[torch.randperm(c.numel(), generator=g)])
    views = [lay.views(arena[e]) for e in range(a.experts)]
    mlp, fused = quant_mlp(lay, F.silu), q4moe.FusedMoE(lay)
    q4moe.warm()
    steps = [torch.randperm(a.experts, generator=g)[:a.k].tolist() for _ in range(a.steps)]
    xs = [torch.randn(1, a.d, generator=g).to(dtype) for _ in range(a.steps)]
    ws = [torch.softmax(torch.randn(a.k, generator=g), 0) for _ in range(a.steps)]

    def per_expert(x, ids, w):  # step.py's per-expert path and combine
        h = {e: mlp(x, views[e])[0] for e in ids}
        es = sorted(h)
        h_UD = torch.stack([h[e] for e in es])
        perm = torch.tensor(ids).argsort()
        hw = (h_UD * w[perm, None]).to(x.dtype)
        out = torch.zeros_like(x[0])
        for r in hw.unbind(0):
            out.add_(r)
        return out

    def fused_at(n):
        def run(x, ids, w):
            es = sorted(ids)
            at = {e: i for i, e in enumerate(ids)}
            return q4moe.fused_moe(x[0], [views[e] for e in es], [float(w[at[e]]) for e in es], a.d, lay.f_pad,
                                   a.group, threads=n)
        return run

    variants = {"per-expert": per_expert, **{f"fused-{n}t": fused_at(n) for n in a.threads}}
    for fn in variants.values():  # warm-up (compiles, first touches)
        fn(xs[0], steps[0], ws[0])
    got = {k: [] for k in variants}
    from expertcache.results import append_jsonl

    names = list(variants)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # order rotated per round
            fn = variants[name]
            t0 = time.perf_counter()
            for x, ids, w in zip(xs, steps, ws):
                fn(x, ids, w)
            ms = (time.perf_counter() - t0) / a.steps * 1e3
            got[name].append(ms)
            if a.out:  # one whole row at a time (results.append_jsonl)
                append_jsonl(a.out, {"bench": "fused_moe", "variant": name, "round": r, "ms_per_layer": ms,
                                     "d": a.d, "f": a.f, "k": a.k, "experts": a.experts, "group": a.group,
                                     "dtype": a.dtype, "avx2": q4x8.use_avx2()})
    base = statistics.median(got["per-expert"])
    print(f"D={a.d} F={a.f} K={a.k} of {a.experts} G={a.group} {a.dtype}, {a.rounds} rounds x {a.steps} layer-steps "
          f"(AVX2 {q4x8.use_avx2()})")
    print("| variant | ms per layer-step (median) | vs per-expert |\n|---|---|---|")
    for name, ms in got.items():
        m = statistics.median(ms)
        print(f"| {name} | {m:.3f} | {base / m:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

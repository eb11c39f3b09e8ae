"""The int4 least-squares group fit (``--quant q4`` / ``q4m``, ``optimize="lsq"``): torch's tensor-op reference
against the compiled loops of offload/groupfit.py, on OLMoE-1B-7B expert matrices (gate_up [2048, 2048], down
[2048, 1024], G = 64), bf16 Student-t(5)·0.02 weights (a checkpoint's values, heavy-tailed as trained weights are).

    python benchmarks/bench_lsq.py [--experts 8] [--rounds 3] [--threads 1,2] [--group 64]
        [--label NAME] [--out benchmarks/results/lsq.jsonl]

Competitors, interleaved per round (order rotated), at each ``--threads`` count (``torch.set_num_threads`` for
torch, that many threads of the compiled blocks):

- ``torch fit`` / ``compiled fit``: the fit alone (``groupfit.lsq_torch`` / ``groupfit.lsq``: s, m per group);
- ``torch quantize`` / ``compiled quantize``: the whole int4 step of ``quantize_codes`` (ranges, fit, storage
  rounding of s and z to bf16, codes: ``groupfit.quantize_int4_torch`` / ``groupfit.quantize_int4``).

One JSONL row per (competitor, threads, round): wall seconds for ``--experts`` experts and that scaled to one
OLMoE-1B-7B layer (64 experts), the relative reconstruction error ``|dequant(W) - W| / |W|`` over the matrices
(min/max's too), the load average, the machine (``offload.bench.machine_info``). Medians over rounds are printed
as a markdown table with the speed-up of the compiled loops over torch's at the same thread count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "results" / "lsq.jsonl"
D, F, LAYER_EXPERTS = 2048, 1024, 64
COMPETITORS = ("torch fit", "compiled fit", "torch quantize", "compiled quantize")


def _weights(experts: int, seed: int = 0) -> list[torch.Tensor]:
    """Each expert's gate_up [2F, D] and down [D, F], bf16 Student-t(5)·0.02 held as float32 (quantize_codes'
    input)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(experts):
        for n, k in ((2 * F, D), (D, F)):
            z = torch.randn(n, k, generator=g)
            chi2 = torch.randn(5, n, k, generator=g).pow(2).sum(0)
            out.append((0.02 * z / (chi2 / 5).sqrt()).bfloat16().float())
    return out


def _run(name: str, mats: list[torch.Tensor], group: int, threads: int):
    from expertcache.offload import groupfit

    out = []
    for w in mats:
        wb = w.view(w.shape[0], -1, group)
        if name.endswith("fit"):
            lo, hi = wb.amin(2), wb.amax(2)
            out.append(groupfit.lsq_torch(wb, lo, hi) if name.startswith("torch")
                       else groupfit.lsq(wb, lo, hi, n_threads=threads))
        elif name.startswith("torch"):
            out.append(groupfit.quantize_int4_torch(wb, torch.bfloat16, "lsq"))
        else:
            out.append(groupfit.quantize_int4(wb, torch.bfloat16, "lsq", n_threads=threads))
    return out


def _rel_err(mats, results, group: int) -> float:
    num = den = 0.0
    for w, r in zip(mats, results):
        wb = w.view(w.shape[0], -1, group)
        if len(r) == 2:  # a fit: s, m in float32, the codes their rounding
            s, m = r
            q = torch.round((wb - m[..., None]) / s[..., None]).clamp(0, 15)
            wr = q * s[..., None] + m[..., None]
        else:
            q, s, z = r
            wr = (q - 8) * s[..., None] + z[..., None]
        num += float((wr - wb).double().pow(2).sum())
        den += float(wb.double().pow(2).sum())
    return (num / den) ** 0.5


def run(args) -> list[dict]:
    from expertcache import compiled
    from expertcache.offload import groupfit
    from expertcache.offload.bench import machine_info

    if not compiled.AVAILABLE:
        raise SystemExit("bench_lsq: the compiled fit needs numba (and EXPERTCACHE_NO_NUMBA unset)")
    mats = _weights(args.experts)
    groupfit.quantize_int4(mats[0][:64].view(64, -1, args.group), torch.bfloat16, "lsq")  # compile / load now
    minmax = _rel_err(mats, [groupfit.quantize_int4(w.view(w.shape[0], -1, args.group), torch.bfloat16, "minmax")
                             for w in mats], args.group)
    machine = machine_info()
    rows, errs = [], {}
    for r in range(args.rounds):
        for t in args.threads:
            torch.set_num_threads(t)
            names = list(COMPETITORS)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                load = os.getloadavg()[0]
                t0, c0 = time.perf_counter(), time.process_time()
                got = _run(name, mats, args.group, t)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if name not in errs:
                    errs[name] = _rel_err(mats, got, args.group)
                row = dict(kind="lsq", label=args.label, competitor=name, threads=t, round=r, experts=args.experts,
                           group=args.group, dtype="bfloat16", shapes=[[2 * F, D], [D, F]], seconds=wall,
                           cpu_seconds=cpu, seconds_per_layer=wall * LAYER_EXPERTS / args.experts,
                           rel_err=errs[name], rel_err_minmax=minmax, loadavg_1m=load, machine=machine)
                rows.append(row)
                print(f"round {r} threads {t} {name}: {wall:.2f} s ({row['seconds_per_layer']:.1f} s a layer), "
                      f"rel err {errs[name]:.5f}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| threads | competitor | median s / layer (64 experts) | speed-up vs torch | median CPU s / layer | "
           "rel. error |", "|---|---|---|---|---|---|"]
    med, cpu = {}, {}
    for row in rows:
        med.setdefault((row["threads"], row["competitor"]), []).append(row["seconds_per_layer"])
        cpu.setdefault((row["threads"], row["competitor"]), []).append(
            row["cpu_seconds"] * LAYER_EXPERTS / row["experts"])
    for (t, name), xs in sorted(med.items()):
        m = statistics.median(xs)
        ref = statistics.median(med.get((t, name.replace("compiled", "torch")), xs))
        err = next(r["rel_err"] for r in rows if r["competitor"] == name)
        out.append(f"| {t} | {name} | {m:.2f} | {ref / m:.1f}× | {statistics.median(cpu[t, name]):.2f} | {err:.5f} |")
    out.append(f"(min/max rel. error {rows[0]['rel_err_minmax']:.5f}; load average {rows[0]['loadavg_1m']:.2f} at the "
               f"first row, {rows[-1]['loadavg_1m']:.2f} at the last)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8, help="experts timed (rows scale to a 64-expert layer)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from expertcache.results import append_jsonl, check_rows_out

    check_rows_out(ap, args.out)
    args.threads = [int(x) for x in args.threads.split(",")]
    if args.experts < 1 or args.rounds < 1 or min(args.threads) < 1 or args.group not in (32, 64, 128, 256):
        print("bench_lsq: --experts, --rounds and --threads must be ≥ 1, --group one of 32/64/128/256",
              file=sys.stderr)
        return 2
    rows = run(args)
    for row in rows:
        append_jsonl(args.out, row)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Offloaded decode throughput: every policy on the shipped granular model at C = N/2 and N/4, and the
OLMoE-1B-7B-shape random-weight model (a few layers) with flash-faithful disk reads at C = N/2, against the
physical floor max(compute, bytes ÷ device bandwidth) (see expertcache.offload.bench).

    nice -n 10 python benchmarks/bench_offload.py [--layers 4] [--tokens 32] [--repeats 3] [--threads 1]
        [--readers 4] [--prefetch P] [--label NAME]

Writes benchmarks/results/offload.jsonl (one row per policy and round) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from expertcache.offload import OffloadConfig
from expertcache.offload.bench import machine_info, run_bench, table
from expertcache.offload.make_model import make_bench_model
from expertcache.offload.runtime import resolve_model_path
from expertcache.results import append_jsonl

OUT = Path(__file__).resolve().parent / "results" / "offload.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--readers", type=int, default=OffloadConfig().readers, help="reader threads (0 = serial)")
    ap.add_argument("--prefetch", type=int, default=0, help="next-layer prefetch spare slots per layer (0 = off)")
    ap.add_argument("--label", default="", help="label stored in every row (e.g. readers4-prefetch8)")
    ap.add_argument("--only", choices=("granular", "olmoe", "ppl"), default=None)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_info()}", flush=True)
    out = lambda row: append_jsonl(args.out, dict(row, bench="bench_offload.py", label=args.label))
    io = dict(readers=args.readers, prefetch=args.prefetch)
    log = lambda *a: print(*a, flush=True)
    if args.only in (None, "granular"):
        path = resolve_model_path("granular")
        from expertcache.cli.bench import _prompt

        prompt = _prompt(path, 16, 1, 0)
        for c in (16, 8):
            log(f"\n## granular (OLMoE 32 experts, top-8, trained), C={c}/32, disk io=direct")
            res = run_bench(path, OffloadConfig(tier="disk", io="direct", capacity=c, context=16 + args.tokens, **io),
                            prompt_BS=prompt, tokens=args.tokens, repeats=args.repeats, on_row=out, log=log)
            log(table(res))
    if args.only in (None, "ppl"):
        for row in quant_ppl():
            append_jsonl(args.out, dict(row, bench="bench_offload.py"))
    if args.only in (None, "olmoe"):
        path = make_bench_model("olmoe-1b-7b", layers=args.layers)
        prompt = torch.randint(3, 50304, (1, 16), generator=torch.Generator().manual_seed(0))
        log(f"\n## olmoe-1b-7b shape (random weights, {args.layers} layers), C=32/64, disk io=direct")
        forced = torch.randint(3, 50304, (1, args.tokens), generator=torch.Generator().manual_seed(1))
        res = run_bench(path, OffloadConfig(tier="disk", io="direct", capacity=32, context=16 + args.tokens, **io),
                        policies=["original+lru", "cache-prior"], prompt_BS=prompt, tokens=args.tokens,
                        forced_BN=forced,
                        repeats=args.repeats, on_row=out, log=log)
        log(table(res))
    return 0


def quant_ppl(model: str = "granular", seq_len: int = 128, windows: int = 16) -> list[dict]:
    """Held-out perplexity of bf16, int8 and int4 experts (the fused kernels' layouts, default int4 group: 32 with
    K padded on the shipped models), all experts resident, original routing."""
    from expertcache.offload import OffloadedModel
    from expertcache.offload.bench import heldout_ppl, heldout_stream

    path = resolve_model_path(model)
    stream = heldout_stream(path)
    rows = []
    for quant in (None, "int8", "int4"):
        rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant=quant))
        rows.append(dict(kind="offload-quant-ppl", model=model, quant=quant or "bf16", group=rt.offload.group, ppl=heldout_ppl(rt, stream, seq_len, windows),
                         expert_bytes=rt.expert_bytes, tokens=(seq_len - 1) * windows))
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())

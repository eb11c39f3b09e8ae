"""Project bench_tiers.py's routing decisions onto OLMoE-1B-7B-sized experts (docs/BEYOND.md).

The shipped model's experts are 88 KiB: a disk read and a host copy of one cost about the same on this VM
(the per-load hand-off dominates), so tiers barely matter there. This script asks what the same routing
decisions -- the per-token host hits and disk reads that ``bench_tiers.py`` measured, each with its
perplexity -- cost with 12 MiB experts (the OLMoE-1B-7B shape; the bench checkpoint of ``expertcache bench
--make-model olmoe-1b-7b --layers 4``), with every constant **measured here** on that checkpoint:

- ``t_disk``: one expert read with the runtime's own O_DIRECT disk tier (into a page-aligned slot);
- ``t_host``: one expert copied host slot → fast slot (the host level's copy);
- ``t_compute``: the runtime's decode compute per token (decode time − read waits, all experts of a token
  in fast slots: Cache-Prior λ = 1 after a warm-up), scaled from 4 to the checkpoint's layers as measured.

Projected s/token = t_compute + host hits/token × t_host + disk reads/token × t_disk (serial: reads not
overlapped with compute, an upper bound) and the floor max(t_compute, host·t_host + disk·t_disk) (perfect
overlap). It is a projection, not a measured end-to-end run: the decisions come from the shipped model
(N = 32 of the checkpoint's 64 experts, same L = 4), the costs from the big one.

    python benchmarks/bench_tiers_project.py --rows docs/results/tiers/rows.jsonl \\
        --model ~/.cache/expertcache/bench-models/olmoe-1b-7b-L4-e1
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", required=True, help="rows.jsonl of bench_tiers.py")
    ap.add_argument("--model", default=str(Path("~/.cache/expertcache/bench-models/olmoe-1b-7b-L4-e1").expanduser()))
    ap.add_argument("--reads", type=int, default=24, help="expert reads / copies timed (median)")
    ap.add_argument("--tokens", type=int, default=6, help="decode tokens for the compute time")
    ap.add_argument("--out", default=None, help="markdown output (default: next to --rows)")
    ap.add_argument("--assume", action="append", default=[], metavar="NAME=COMPUTE_MS,HOST_MS,DISK_MS",
                    help="also project with these *assumed* (not measured) constants, e.g. a GPU: "
                         "gpu=6,0.5,4.2 (repeatable)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.routing import RoutingConfig

    rows = [json.loads(line) for line in open(args.rows)]
    rt = OffloadedModel.from_pretrained(args.model, OffloadConfig(capacity=8, io="direct", readers=4, context=64),
                                        routing=RoutingConfig("cache-prior", lam=1.0))
    n = rt.slot_bytes
    fast = mmap.mmap(-1, n)
    host = mmap.mmap(-1, n)
    fast_u8 = torch.frombuffer(fast, dtype=torch.uint8)
    host_u8 = torch.frombuffer(host, dtype=torch.uint8)
    disk_s, host_s = [], []
    for i in range(args.reads):  # different experts each time (no device cache helps O_DIRECT anyway)
        li, e = i % len(rt.layers), (7 * i) % rt.num_experts
        key = (li, e)
        t0 = time.perf_counter()
        rt.tier.read(rt._parts[key], rt._placement[key], fast_u8)
        disk_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        host_u8[:rt._placement[key].nbytes].copy_(fast_u8[:rt._placement[key].nbytes])
        fast_u8[:rt._placement[key].nbytes].copy_(host_u8[:rt._placement[key].nbytes])
        host_s.append((time.perf_counter() - t0) / 2)
    t_disk, t_host = statistics.median(disk_s), statistics.median(host_s)
    # compute per token: decode with the token's experts resident (λ = 1 keeps nearly all hits), minus read waits
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, rt.config.vocab_size, (1, 4 + args.tokens), generator=gen)
    rt.warm()
    r = rt.generate(ids[:, :4], args.tokens, forced_BN=ids[:, 4:])
    d = r["decode_stats"]
    t_compute = (r["decode_s"] - d["io_wait_seconds"]) / max(1, r["decode_tokens"])
    rt.close()

    def med(pol, lam, key):
        return statistics.median(x[key] for x in rows if x["policy"] == pol and x["lam"] == lam)

    lams = sorted({x["lam"] for x in rows})

    def project(t_compute, t_host, t_disk):
        proj = {}
        for pol in ("cache-prior", "cache-prior-cost"):
            for lam in lams:
                tok = med(pol, lam, "tokens")
                h, dk = med(pol, lam, "host_hits") / tok, med(pol, lam, "disk_reads") / tok
                io = h * t_host + dk * t_disk
                proj[(pol, lam)] = dict(ppl=med(pol, lam, "ppl"), host=h, disk=dk, serial=1 / (t_compute + io),
                                        floor=1 / max(t_compute, io))
        return proj

    proj = project(t_compute, t_host, t_disk)
    md = [f"Projection onto `{Path(args.model).name}` (expert {rt.expert_bytes / 2**20:.1f} MiB): measured "
          f"t_disk = {t_disk * 1e3:.2f} ms (O_DIRECT), t_host = {t_host * 1e3:.2f} ms (copy), t_compute = "
          f"{t_compute * 1e3:.1f} ms/token; decisions and perplexities of `{args.rows}`.", "",
          "| policy | λ | perplexity | host hits / tok | disk reads / tok | tok/s serial | tok/s floor |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for (pol, lam), p in proj.items():
        md.append(f"| {pol} | {lam:g} | {p['ppl']:.3f} | {p['host']:.2f} | {p['disk']:.2f} | {p['serial']:.2f} | "
                  f"{p['floor']:.2f} |")

    def plain_at(ppl, key, proj):
        front = []
        for p in sorted((v["ppl"], v[key]) for (pol, _), v in proj.items() if pol == "cache-prior"):
            if not front or p[1] > front[-1][1]:
                front.append(p)
        if ppl < front[0][0]:
            return None
        for (p0, s0), (p1, s1) in zip(front, front[1:]):
            if p0 <= ppl <= p1:
                return s0 if p1 == p0 else s0 + (s1 - s0) * (ppl - p0) / (p1 - p0)
        return front[-1][1]

    def speedups(proj, title):
        out = ["", title, "", "| cost-aware λ | perplexity | speed-up serial | speed-up floor |",
               "|---:|---:|---:|---:|"]
        for lam in lams:
            p = proj[("cache-prior-cost", lam)]
            a, b = plain_at(p["ppl"], "serial", proj), plain_at(p["ppl"], "floor", proj)
            sa = "—" if a is None else f"{p['serial'] / a:.3f}×"
            sb = "—" if b is None else f"{p['floor'] / b:.3f}×"
            out.append(f"| {lam:g} | {p['ppl']:.3f} | {sa} | {sb} |")
        return out

    md += speedups(proj, "Cost-aware at equal perplexity, measured constants (plain Cache-Prior's Pareto frontier "
                         "interpolated):")
    for spec in args.assume:
        name, vals = spec.split("=")
        c, h, d = (float(v) / 1e3 for v in vals.split(","))
        md += speedups(project(c, h, d), f"**Assumed** constants `{name}` (not measured here): t_compute = "
                                         f"{c * 1e3:g} ms/token, t_host = {h * 1e3:g} ms, t_disk = {d * 1e3:g} ms:")
    text = "\n".join(md) + "\n"
    out = Path(args.out) if args.out else Path(args.rows).with_name("projection.md")
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quantised experts (and dense weights) on torch's fused kernels: the per-expert kernel time and the decode speed
with every expert resident (C = N, host tier), OLMoE-1B-7B shapes.

    nice -n 10 python benchmarks/bench_quant.py [--layers 4] [--tokens 16] [--repeats 3] [--threads 1]
        [--only kernel|decode] [--configs bf16 int8 int4 int4+dense-int8 ...]

1. **kernel**: one OLMoE-1B-7B expert, one token (gate_up [2048, 2048], down [2048, 1024]): the runtime's bf16
   path (two ``torch.mv``), format 1's int4 path (the codes dequantised to bf16 in torch on every use, then
   ``mv``: what ``--quant int4`` did before the fused kernels), and the fused ``_weight_int8pack_mm`` /
   ``_weight_int4pack_mm_for_cpu`` on the packed blob. Competitors interleaved, ``--repeats`` rounds, medians.
2. **decode**: the random-weight OLMoE-1B-7B-shape checkpoint with ``--layers`` layers
   (``expertcache bench --make-model olmoe-1b-7b --layers 4``), every expert resident (C = N = 64, host tier,
   warmed), ``--tokens`` teacher-forced tokens after a 16-token prompt; each round builds every configuration
   in turn (one in memory at a time), rounds interleave the configurations, medians of the decode tok/s.

3. **quality**: closed-loop perplexity of the shipped models (``granular``, ``coarse``) on WikiText-2 test
   (``--chunks`` chunks of 256 tokens from /work/shared/data, the caches carried across chunks), every
   expert precision (bf16 / int8 / int4) × dense precision (none / int8 / int4) × routing (original,
   Cache-Prior λ 0.2), through the offloaded runtime token by token (teacher-forced decode: each token's routing
   sees the live residency of a C = N/2 LRU cache, as in BENCHMARKS.md's quality section).

Writes rows to benchmarks/results/quant.jsonl (``--out``) and prints markdown tables with ratios against bf16
measured in the same rounds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.offload.bench import machine_info
from expertcache.offload.make_model import make_bench_model
from expertcache.offload.quant import QuantLayout, pack_expert, quant_mlp
from expertcache.results import append_jsonl

OUT = Path(__file__).resolve().parent / "results" / "quant.jsonl"
CONFIGS = {  # name -> (expert quant, dense quant)
    "bf16": (None, None), "int8": ("int8", None), "int4": ("int4", None),
    "int8+dense-int8": ("int8", "int8"), "int4+dense-int8": ("int4", "int8"), "int4+dense-int4": ("int4", "int4"),
}


def _median_us(fn, n: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _format1_int4(w_NK: torch.Tensor, group: int):
    """Format 1's int4 expert matrix (min/scale per group of ``group``, two codes a byte) and its per-use
    dequantisation to bf16 (main before the fused kernels: offload/quant.py ``dequantize_matrix``)."""
    w = w_NK.float().reshape(-1, group)
    lo, hi = w.amin(1), w.amax(1)
    s = ((hi - lo) / 15).half()
    m = lo.half()
    q = torch.round((w - m.float()[:, None]) / s.float().clamp(min=2 ** -24)[:, None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(-1)
    packed = q[0::2] | (q[1::2] << 4)
    shape = tuple(w_NK.shape)

    def dequant():
        q_N = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)
        return (q_N.reshape(-1, group).to(torch.bfloat16) * s.to(torch.bfloat16)[:, None]
                + m.to(torch.bfloat16)[:, None]).reshape(shape)
    return dequant


def kernel_rows(repeats: int, n: int = 50) -> list[dict]:
    d, f = 2048, 1024
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(2 * f, d, generator=g) * 0.02).bfloat16()
    down = (torch.randn(d, f, generator=g) * 0.02).bfloat16()
    x = torch.randn(1, d, generator=g).bfloat16()
    act = torch.nn.functional.silu

    def bf16():
        gate, up = torch.mv(gu, x[0]).chunk(2)
        return torch.mv(down, act(gate) * up)

    deq_gu, deq_down = _format1_int4(gu, 64), _format1_int4(down, 64)

    def format1():
        gate, up = torch.mv(deq_gu(), x[0]).chunk(2)
        return torch.mv(deq_down(), act(gate) * up)

    comps = {"bf16 mv": bf16, "format-1 int4 (dequantise per use)": format1}
    for mode in ("int8", "int4"):
        layout = QuantLayout(mode, d, f, 64, torch.bfloat16)
        views = layout.views(pack_expert(gu.float(), down.float(), layout))
        mlp = quant_mlp(layout, act)
        comps[f"fused {mode}"] = (lambda mlp=mlp, views=views: mlp(x, views))
    times = {k: [] for k in comps}
    for _ in range(repeats):
        for k, fn in comps.items():  # interleaved
            times[k].append(_median_us(fn, n))
    return [dict(kind="quant-kernel", what=k, us=statistics.median(v), us_rounds=v, d=d, f=f) for k, v in times.items()]


def decode_rows(layers: int, tokens: int, repeats: int, configs: list[str], log) -> list[dict]:
    path = make_bench_model("olmoe-1b-7b", layers=layers)
    prompt = torch.randint(3, 50304, (1, 16), generator=torch.Generator().manual_seed(0))
    forced = torch.randint(3, 50304, (1, tokens), generator=torch.Generator().manual_seed(1))
    rows = []
    for r in range(repeats):
        order = configs if r % 2 == 0 else configs[::-1]  # alternate the order between rounds
        for name in order:
            quant, dense = CONFIGS[name]
            rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant=quant, quant_dense=dense,
                                                                    context=16 + tokens))
            rt.warm(range(rt.num_experts))
            res = rt.generate(prompt, tokens, forced_BN=forced)
            d = res["decode_stats"]
            row = dict(kind="quant-decode", config=name, round=r, layers=layers, tokens=res["decode_tokens"],
                       decode_tok_s=res["decode_tokens"] / res["decode_s"], misses=d["misses"],
                       expert_bytes=rt.expert_bytes, non_expert_bytes=rt.plan.non_expert_bytes,
                       quant_kernel=rt.describe()["quant_kernel"], threads=torch.get_num_threads())
            log(f"round {r} {name}: {row['decode_tok_s']:.2f} tok/s (expert {rt.expert_bytes / 2**20:.2f} MiB, "
                f"non-expert {row['non_expert_bytes'] / 2**20:.0f} MiB, misses {d['misses']})")
            rows.append(row)
            rt.close()
            del rt
            gc.collect()
    return rows


def quality_rows(models: list[str], chunks: int, log, seq: int = 256) -> list[dict]:
    import math

    from tokenizers import Tokenizer

    from expertcache.eval.data import resolve_eval_data_dir, wikitext_text
    from expertcache.models.loader import resolve_model_path
    from expertcache.routing import RoutingConfig

    text = wikitext_text(resolve_eval_data_dir("wikitext"))
    rows = []
    for model in models:
        path = resolve_model_path(model)
        ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        chunks_NS = torch.tensor(ids[:chunks * seq]).view(chunks, seq)
        for experts in ("bf16", "int8", "int4"):
            for dense in ("none", "int8", "int4"):
                q = None if experts == "bf16" else experts
                rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant=q, context=seq,
                                                                        quant_dense=None if dense == "none" else dense))
                for routing in (RoutingConfig(), RoutingConfig(policy="cache-prior", lam=0.2)):
                    rt.configure(routing=routing, capacity=rt.num_experts // 2)
                    t0 = time.perf_counter()
                    nll, count = 0.0, 0
                    with torch.inference_mode():
                        for chunk_S in chunks_NS:
                            logits_BV, past = rt.prefill(chunk_S[None, :1])
                            for t in range(1, seq):
                                nll -= torch.log_softmax(logits_BV[0].float(), -1)[chunk_S[t]].item()
                                count += 1
                                if t < seq - 1:
                                    logits_BV, past = rt.decode_one_token(chunk_S[None, t:t + 1], past)
                    s = rt.stats()
                    row = dict(kind="quant-quality", model=model, experts=experts, dense=dense,
                               routing=routing.label(), capacity=rt.capacity, num_experts=rt.num_experts,
                               ppl=math.exp(nll / count), tokens=count, miss_rate=s["misses"] / max(1, s["accesses"]),
                               expert_bytes=rt.expert_bytes, non_expert_bytes=rt.plan.non_expert_bytes,
                               group=rt.offload.group, seconds=time.perf_counter() - t0)
                    log(f"{model} experts={experts} dense={dense} {row['routing']}: ppl {row['ppl']:.2f}, "
                        f"miss rate {row['miss_rate']:.3f} ({row['seconds']:.0f} s)")
                    rows.append(row)
                rt.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=("kernel", "decode", "quality"), default=None)
    ap.add_argument("--chunks", type=int, default=4, help="quality: WikiText chunks of 256 tokens")
    ap.add_argument("--models", nargs="+", default=["granular", "coarse"], help="quality: shipped models")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    with open("/proc/loadavg") as f:
        info["loadavg"] = f.read().split()[:3]
    print(f"machine: {info}", flush=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = lambda row: append_jsonl(args.out, dict(row, bench="bench_quant.py", machine=info, date=stamp))
    if args.only in (None, "kernel"):
        rows = kernel_rows(args.repeats)
        base = next(r["us"] for r in rows if r["what"] == "bf16 mv")
        print("\n| one OLMoE expert, one token | µs (median) | × bf16 |\n|---|---:|---:|")
        for r in rows:
            out(r)
            print(f"| {r['what']} | {r['us']:.0f} | {base / r['us']:.2f} |")
    if args.only in (None, "decode"):
        rows = decode_rows(args.layers, args.tokens, args.repeats, args.configs, lambda *a: print(*a, flush=True))
        for r in rows:
            out(r)
        med = {c: statistics.median(r["decode_tok_s"] for r in rows if r["config"] == c) for c in args.configs}
        base = med.get("bf16")
        print(f"\n| C = N, host tier, {args.layers} layers | tok/s (median of {args.repeats}) | × bf16 |\n|---|---:|---:|")
        for c in args.configs:
            print(f"| {c} | {med[c]:.2f} | {med[c] / base if base else float('nan'):.2f} |")
    if args.only in (None, "quality"):
        rows = quality_rows(args.models, args.chunks, lambda *a: print(*a, flush=True))
        for r in rows:
            out(r)
        print("\n| model | experts | dense | routing | ppl | vs bf16/none | miss rate |\n|---|---|---|---|---:|---:|---:|")
        for r in rows:
            base = next(b["ppl"] for b in rows if b["model"] == r["model"] and b["routing"] == r["routing"]
                        and b["experts"] == "bf16" and b["dense"] == "none")
            print(f"| {r['model']} | {r['experts']} | {r['dense']} | {r['routing']} | {r['ppl']:.2f} | "
                  f"{100 * (r['ppl'] / base - 1):+.2f} % | {r['miss_rate']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

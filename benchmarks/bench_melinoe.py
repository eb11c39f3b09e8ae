"""MELINOE (004) report tables on the shipped models, held-out split of corpus-debian-docs.

Closed loop (expertcache.eval.evaluate on the patched model): sequences are consecutive ``--seq``-token chunks of
the held-out documents (joined), one sequence per chunk, caches reset between sequences (004 measures per
sequence); the predictor sees each chunk's first ``prompt_len`` tokens (its training prompt length) and its
Top-C per layer is loaded before the chunk runs. Transfers per layer per token = demand misses / (tokens · L)
(prefetch loads reported apart); perplexity over every predicted token of the chunks.

Offloaded runtime (disk tier, ``io=direct``): ``--runtime-prompts`` held-out prompts, greedy decode of
``--runtime-tokens`` tokens each, decode tok/s; rounds interleave the configurations; medians reported.

Writes JSONL rows to ``--out`` and prints markdown tables.

    python benchmarks/bench_melinoe.py --model granular --tuned runs/melinoe-granular/model \\
        --base-predictor runs/pred-granular-base --tuned-predictor runs/pred-granular-tuned --out runs/bench-granular.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def heldout_text(data_dir, max_chars: int) -> str:
    from expertcache.melinoe.data import split_texts

    texts, n = [], 0
    for t in split_texts(data_dir, split="heldout", seed=0):
        texts.append(t)
        n += len(t)
        if n >= max_chars:
            break
    return "\n\n".join(texts)


def closed_loop(model, tok, task, routing, eviction, capacity, predictor, prompt_len):
    from expertcache.eval import evaluate
    from expertcache.melinoe.prefetch import PatchPrefetcher, item_prompt_texts

    pre = None
    if predictor is not None:
        texts = item_prompt_texts(task, tok, prompt_len)
        pre = lambda patch, t: PatchPrefetcher(predictor, texts, model, tok).install(patch)  # noqa: E731
    row = evaluate(model, task, routing, eviction=eviction, capacity=capacity, between_sequences="reset",
                   prefetch=pre)
    k = row["config"]["top_k"]
    return dict(ppl=row["quality"], transfers_per_layer_token=row["miss_rate"] * k, miss_rate=row["miss_rate"],
                prefetched=row.get("prefetched", 0), items=row["task_metrics"]["items"])


def runtime_rounds(configs, prompts_ids, prompt_texts, tokens, rounds, capacity, log):
    """Decode tok/s of each (name, path, predictor, tok) in the offloaded runtime, rounds interleaved."""
    from expertcache.melinoe.prefetch import prefetch_runtime
    from expertcache.offload import OffloadConfig, OffloadedModel

    rts = {name: (OffloadedModel.from_pretrained(path, OffloadConfig(tier="disk", io="direct", capacity=capacity)),
                  pred, tok) for name, path, pred, tok in configs}
    res = {name: [] for name in rts}
    for rep in range(rounds):
        order = list(rts)[rep % len(rts):] + list(rts)[:rep % len(rts)]
        for name in order:
            rt, pred, tok = rts[name]
            dec_s, dec_n, misses, steps = 0.0, 0, 0, 0
            for ids, text in zip(prompts_ids, prompt_texts):
                rt.configure()
                if pred is not None:
                    prefetch_runtime(rt, pred, [text], tok)
                r = rt.generate(ids, tokens)
                dec_s += r["decode_s"]
                dec_n += r["decode_tokens"]
                misses += r["decode_stats"]["misses"]
            res[name].append(dict(tok_s=dec_n / dec_s, decode_misses_per_layer_token=misses / dec_n / len(rt.layers)))
            log(f"  runtime [{rep + 1}/{rounds}] {name:<28} {dec_n / dec_s:7.1f} tok/s")
    return {name: dict(tok_s=statistics.median(r["tok_s"] for r in rs),
                       decode_transfers_per_layer_token=statistics.median(r["decode_misses_per_layer_token"] for r in rs),
                       rounds=len(rs))
            for name, rs in res.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="base: granular | coarse | folder")
    ap.add_argument("--tuned", required=True, help="fine-tuned checkpoint folder (melinoe finetune OUT/model)")
    ap.add_argument("--base-predictor", required=True)
    ap.add_argument("--tuned-predictor", required=True)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--seq", type=int, default=96, help="tokens per held-out sequence (default 96)")
    ap.add_argument("--sequences", type=int, default=32, help="held-out sequences (default 32)")
    ap.add_argument("--capacities", default="", help="comma-separated C (default E/4, E/2)")
    ap.add_argument("--lams", default="0.05,0.1", help="cache-prior λ values (default 0.05,0.1)")
    ap.add_argument("--runtime-prompts", type=int, default=3)
    ap.add_argument("--runtime-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True, help="JSONL output")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from expertcache.eval.runner import load_model_and_tokenizer, resolve_model_path
    from expertcache.eval.tasks import WikiTextTask
    from expertcache.melinoe.predictor import Predictor
    from expertcache.results import append_jsonl
    from expertcache.routing import RoutingConfig

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    preds = {"base": Predictor.load(args.base_predictor), "tuned": Predictor.load(args.tuned_predictor)}
    models = {}
    for name, spec in (("base", args.model), ("tuned", args.tuned)):
        models[name] = load_model_and_tokenizer(spec)
    tok = models["base"][1]
    text = heldout_text(args.data_dir, max_chars=args.seq * args.sequences * 8)
    task = WikiTextTask(tok, context=args.seq, text=text, limit=args.sequences)
    e = int(models["base"][0].config.num_experts if hasattr(models["base"][0].config, "num_experts")
            else models["base"][0].config.num_local_experts)
    caps = [int(c) for c in args.capacities.split(",")] if args.capacities else [e // 4, e // 2]
    prompt_len = int(preds["base"].meta["config"]["prompt_len"])
    rows = []

    def record(**row):
        row.update(bench="bench_melinoe.py", model=args.model, seq=args.seq, sequences=args.sequences)
        rows.append(row)
        append_jsonl(args.out, row)

    t0 = time.time()
    # Table 3 analogue: base vs tuned, without / with prefetch (original routing), LRU and γ caches
    for c in caps:
        for ev in ("lru", "gamma"):
            for ck in ("base", "tuned"):
                model, _ = models[ck]
                for pf in (False, True):
                    r = closed_loop(model, tok, task, RoutingConfig(), ev, c, preds[ck] if pf else None, prompt_len)
                    record(table="3", checkpoint=ck, prefetch=pf, routing="original", eviction=ev, capacity=c, **r)
                    log(f"C={c} {ev:<6} {ck:<5} prefetch={pf!s:<5} Tx/L/token {r['transfers_per_layer_token']:.3f} "
                        f"ppl {r['ppl']:.3f}  ({time.time() - t0:.0f} s)")
    # Table 5 analogue: the tuned checkpoint (and the base, for reference) under training-free policies
    for c in caps:
        for ck in ("base", "tuned"):
            model, _ = models[ck]
            for ev in ("lru", "gamma"):  # original routing: the Table 3 rows without prefetch
                r = next(dict(x) for x in rows if x.get("table") == "3" and x["capacity"] == c and x["checkpoint"] == ck
                         and not x["prefetch"] and x["eviction"] == ev)
                for key in ("table", "checkpoint", "prefetch", "routing", "eviction", "capacity", "bench", "model",
                            "seq", "sequences"):
                    r.pop(key, None)
                record(table="5", checkpoint=ck, policy=f"original+{ev}", eviction=ev, capacity=c, **r)
            for lam in args.lams.split(","):
                label, rc, ev = f"cache-prior(λ={lam})+lru", RoutingConfig(policy="cache-prior", lam=float(lam)), "lru"
                r = closed_loop(model, tok, task, rc, ev, c, None, prompt_len)
                record(table="5", checkpoint=ck, policy=label, eviction=ev, capacity=c, **r)
                log(f"C={c} {ck:<5} {label:<24} Tx/L/token {r['transfers_per_layer_token']:.3f} ppl {r['ppl']:.3f}")
    # offloaded runtime, disk tier, C = E/4
    ids_all = [row[:prompt_len][None] for row in task.chunks_NS[: args.runtime_prompts]]
    texts = [tok.decode(i[0].tolist()) for i in ids_all]
    configs = [(f"{ck}{'+prefetch' if pf else ''}", str(resolve_model_path(args.model if ck == "base" else args.tuned)),
                preds[ck] if pf else None, tok) for ck in ("base", "tuned") for pf in (False, True)]
    rt = runtime_rounds(configs, ids_all, texts, args.runtime_tokens, args.rounds, caps[0], log)
    for name, r in rt.items():
        record(table="3-runtime", name=name, capacity=caps[0], tier="disk", io="direct", **r)
    log(f"done in {time.time() - t0:.0f} s")
    print(json.dumps(dict(rows=len(rows)), indent=None))
    return 0




def markdown(path: str) -> str:
    """Markdown tables (Table 3 and Table 5 analogues) from a results JSONL."""
    rows = [json.loads(l) for l in open(path) if l.strip()]
    out = []
    rt = {r["name"]: r for r in rows if r.get("table") == "3-runtime"}
    t3 = [r for r in rows if r.get("table") == "3"]
    for c in sorted({r["capacity"] for r in t3}):
        out.append(f"\n**{rows[0]['model']}, C = {c}** (transfers per layer per token, closed loop; held-out ppl)\n")
        out.append("| setting | LRU Tx/L/token | γ Tx/L/token | ppl |" + (" tok/s (disk, C=E/4) |" if rt else ""))
        out.append("|---|---|---|---|" + ("---|" if rt else ""))
        for ck in ("base", "tuned"):
            for pf in (False, True):
                sel = {r["eviction"]: r for r in t3 if r["capacity"] == c and r["checkpoint"] == ck
                       and r["prefetch"] == pf}
                name = ("Base model" if ck == "base" else "Fine-tuned") + (" + prefetch" if pf else "")
                line = (f"| {name} | {sel['lru']['transfers_per_layer_token']:.3f} | "
                        f"{sel['gamma']['transfers_per_layer_token']:.3f} | {sel['lru']['ppl']:.3f} |")
                key = f"{ck}{'+prefetch' if pf else ''}"
                if rt:
                    line += f" {rt[key]['tok_s']:.1f} |" if c == min(r["capacity"] for r in t3) else " |"
                out.append(line)
    t5 = [r for r in rows if r.get("table") == "5"]
    if t5:
        out.append("\n**Training-free policies on the base and the fine-tuned checkpoint** (Tx/L/token, ppl)\n")
        caps = sorted({r["capacity"] for r in t5})
        out.append("| policy | " + " | ".join(f"base C={c} | tuned C={c}" for c in caps) + " |")
        out.append("|---|" + "---|---|" * len(caps))
        for pol in dict.fromkeys(r["policy"] for r in t5):
            cells = []
            for c in caps:
                for ck in ("base", "tuned"):
                    r = next(r for r in t5 if r["policy"] == pol and r["capacity"] == c and r["checkpoint"] == ck)
                    cells.append(f"{r['transfers_per_layer_token']:.3f} ({r['ppl']:.2f})")
            out.append(f"| {pol} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if len(sys.argv) == 3 and sys.argv[1] == "--markdown":
        print(markdown(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())

"""MELINOE (004) frontier on the held-out split: perplexity against expert transfers, fine-tuned vs training-free.

For the base model and every fine-tuned checkpoint (``--tuned NAME=PATH``, e.g. one per λ_cs and one per
preset), closed loop (:func:`expertcache.eval.evaluate` on the patched model), at each cache size C:

- ``original+lru``, ``original+gamma`` (004's γ cache), ``cache-prior(λ)+lru`` for every λ of ``--base-lams``
  (base) / ``--tuned-lams`` (fine-tuned), and ``original+lru+prefetch`` when a predictor is given for the
  checkpoint (``--predictor NAME=PATH``; ``base`` names the base model's).

**Transfers always include the prefetch loads**: transfers per token per layer = (demand misses + predictor
prefetch loads) / (tokens · L) -- the eval row's ``transfers_per_token_layer``. A prefetch row also carries
``net_transfers_per_token_layer`` (its transfers minus the same requests' misses without prefetching -- the same
checkpoint's ``original+lru`` row: negative = prefetch saves loads) and the predictor's held-out top-C recall
against the frequency prior (from ``melinoe predictor``'s report).

Sequences: consecutive ``--seq``-token chunks of the held-out documents of corpus-debian-docs (joined), one
sequence per chunk, caches reset between sequences (004 measures per sequence); the predictor sees each chunk's
first ``prompt_len`` tokens; perplexity over every predicted token of the chunks.

Writes JSONL rows to ``--out``, the frontier plot to ``--figure`` and prints the markdown tables:

    python benchmarks/bench_melinoe.py --model granular --tuned cs1=runs/f26/fast-cs1.0/model \\
        --predictor base=runs/f26/pred-base --predictor cs1=runs/f26/pred-cs1 --out runs/f26/frontier.jsonl \\
        --figure docs/figures/melinoe-frontier-granular.png
    python benchmarks/bench_melinoe.py --markdown runs/f26/frontier.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

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


def closed_loop(model, tok, task, routing, eviction, capacity, predictor=None, prompt_len=32, gamma=0.9) -> dict:
    """One closed-loop run; transfers include the predictor's prefetch loads."""
    from expertcache.eval import evaluate
    from expertcache.melinoe.prefetch import PatchPrefetcher, item_prompt_texts

    pre = None
    if predictor is not None:
        texts = item_prompt_texts(task, tok, prompt_len)
        pre = lambda patch, t: PatchPrefetcher(predictor, texts, model, tok).install(patch)  # noqa: E731
    row = evaluate(model, task, routing, eviction=eviction, capacity=capacity, gamma=gamma,
                   between_sequences="reset", prefetch=pre)
    layers = len(row["config"]["moe_layers"])
    out = dict(ppl=row["quality"], transfers_per_token_layer=row["transfers_per_token_layer"],
               demand_misses_per_token_layer=row["misses"] / (row["tokens"] * layers), misses=row["misses"],
               prefetched=row.get("prefetched", 0), transfers=row["transfers"], tokens=row["tokens"],
               layers=layers, items=row["task_metrics"]["items"])
    if "net_transfers" in row:  # prefetch: against the same requests replayed without it
        out.update(net_transfers_per_token_layer=row["net_transfers"] / (row["tokens"] * layers),
                   misses_without_prefetch=row["misses_without_prefetch"],
                   **{k: row[k] for k in ("predictor_recall", "prior_recall", "predictor_beats_prior") if k in row})
    return out


def _named(specs: list[str], flag: str) -> dict[str, str]:
    out = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{flag} {s!r}: expected NAME=PATH")
        if not Path(path).exists():
            raise SystemExit(f"{flag} {s!r}: {path} does not exist")
        out[name] = path
    return out


def recipe_of(path: str) -> dict:
    """The fine-tune's recipe (preset, λ_cs, steps, lr, LoRA) from its ``melinoe_summary.json``."""
    f = Path(path) / "melinoe_summary.json"
    if not f.is_file():
        return {}
    s = json.loads(f.read_text())
    c = s.get("config", {})
    return dict(preset=c.get("preset", "fast"), lambda_cs=c.get("lambda_cs"), lambda_rm=c.get("lambda_rm"),
                steps=s.get("steps_done"), lr=c.get("lr"), seq_len=c.get("seq_len"), lora_r=c.get("lora_r"),
                train_tokens=c.get("train_tokens"), wall_s=s.get("wall_s"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="granular", help="base: granular | coarse | folder")
    ap.add_argument("--tuned", action="append", default=[], metavar="NAME=PATH",
                    help="fine-tuned checkpoint (melinoe finetune OUT/model); repeat")
    ap.add_argument("--predictor", action="append", default=[], metavar="NAME=PATH",
                    help="predictor of checkpoint NAME (base: the base model's); repeat")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--seq", type=int, default=256, help="tokens per held-out sequence (default 256)")
    ap.add_argument("--sequences", type=int, default=32, help="held-out sequences (default 32)")
    ap.add_argument("--capacities", default="", help="comma-separated C (default E/4)")
    ap.add_argument("--base-lams", default="0.1,0.2,0.3,0.5", help="cache-prior λ on the base (default 0.1-0.5)")
    ap.add_argument("--tuned-lams", default="0.1,0.2", help="cache-prior λ on fine-tuned checkpoints")
    ap.add_argument("--gamma", type=float, default=0.9, help="γ of the γ cache (default 0.9)")
    ap.add_argument("--skip-base", action="store_true",
                    help="no base-model rows (they are in --out already from an earlier run with the same --seq, "
                         "--sequences and --capacities)")
    ap.add_argument("--lams-only", action="store_true",
                    help="only the cache-prior rows (extend an earlier run's λ sweep in the same --out)")
    ap.add_argument("--out", required=True, help="JSONL output (appended)")
    ap.add_argument("--figure", default=None, help="frontier PNG (default: none)")
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    torch.set_num_threads(1)

    from expertcache.eval.runner import load_model_and_tokenizer
    from expertcache.eval.tasks import WikiTextTask
    from expertcache.melinoe.predictor import Predictor
    from expertcache.results import append_jsonl
    from expertcache.routing import RoutingConfig

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    tuned = _named(args.tuned, "--tuned")
    if "base" in tuned:
        raise SystemExit("--tuned: the name 'base' is the base model's")
    preds = {k: Predictor.load(v) for k, v in _named(args.predictor, "--predictor").items()}
    unknown = set(preds) - set(tuned) - {"base"}
    if unknown:
        raise SystemExit(f"--predictor {sorted(unknown)}: no such checkpoint (names: base, {', '.join(tuned)})")
    models = {"base": load_model_and_tokenizer(args.model)}
    for name, path in tuned.items():
        models[name] = load_model_and_tokenizer(path)
    tok = models["base"][1]
    text = heldout_text(args.data_dir, max_chars=args.seq * args.sequences * 8)
    task = WikiTextTask(tok, context=args.seq, text=text, limit=args.sequences)
    cfg = models["base"][0].config
    e = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    caps = [int(c) for c in args.capacities.split(",")] if args.capacities else [e // 4]
    t0 = time.time()
    rows = []

    def record(**row):
        row.update(bench="bench_melinoe.py", model=args.model, seq=args.seq, sequences=args.sequences,
                   tokens_total=int(task.chunks_NS.numel()))
        rows.append(row)
        append_jsonl(args.out, row)
        log(f"C={row['capacity']} {row['checkpoint']:<10} {row['policy']:<26} transfers/token/layer "
            f"{row['transfers_per_token_layer']:.3f} ppl {row['ppl']:.3f}  ({time.time() - t0:.0f} s)")

    for c in caps:
        for ck, (model, _) in models.items():
            if ck == "base" and args.skip_base:
                continue
            meta = dict(checkpoint=ck, recipe=recipe_of(tuned[ck]) if ck in tuned else {}, capacity=c)
            lams = args.base_lams if ck == "base" else args.tuned_lams
            if not args.lams_only:
                plain = closed_loop(model, tok, task, RoutingConfig(), "lru", c, gamma=args.gamma)
                record(policy="original+lru", lam=0.0, eviction="lru", prefetch=False, **meta, **plain)
                record(policy="original+gamma", lam=0.0, eviction="gamma", prefetch=False, **meta,
                       **closed_loop(model, tok, task, RoutingConfig(), "gamma", c, gamma=args.gamma))
            for lam in [float(x) for x in lams.split(",") if x.strip()]:
                record(policy=f"cache-prior(λ={lam:g})+lru", lam=lam, eviction="lru", prefetch=False, **meta,
                       **closed_loop(model, tok, task, RoutingConfig(policy="cache-prior", lam=lam), "lru", c))
            if ck in preds and not args.lams_only:
                p = preds[ck]
                r = closed_loop(model, tok, task, RoutingConfig(), "lru", c, p,
                                int(p.meta.get("config", {}).get("prompt_len", 32)))
                # original routing: the replay without prefetch is the plain LRU run (same requests)
                assert r["misses_without_prefetch"] == plain["misses"], (r["misses_without_prefetch"], plain["misses"])
                record(policy="original+lru+prefetch", lam=0.0, eviction="lru", prefetch=True, **meta, **r)
    log(f"done in {time.time() - t0:.0f} s")
    if args.skip_base or args.lams_only:  # the report needs every row: read them all back
        rows = [json.loads(l) for l in open(args.out) if l.strip()]
    if args.figure:
        plot_frontier(rows, args.figure)
    print(markdown_rows(rows))
    return 0


# ---------------------------------------------------------------------------------------------
# report


def _base_curve(rows: list[dict], c: int) -> list[tuple[float, float]]:
    """(ppl, transfers) of base + original/cache-prior + LRU at C, by λ (λ = 0: original routing)."""
    pts = sorted((r["lam"], r["ppl"], r["transfers_per_token_layer"]) for r in rows
                 if r["checkpoint"] == "base" and r["capacity"] == c and r["eviction"] == "lru" and not r["prefetch"])
    return [(p, t) for _, p, t in pts]


def base_transfers_at(rows: list[dict], c: int, ppl: float) -> float | None:
    """base + Cache-Prior's transfers at perplexity ``ppl`` (linear interpolation along its λ curve); None when
    ``ppl`` is outside the curve's range."""
    pts = sorted(_base_curve(rows, c))
    for (p0, t0), (p1, t1) in zip(pts, pts[1:]):
        if p0 <= ppl <= p1:
            return t0 if p1 == p0 else t0 + (t1 - t0) * (ppl - p0) / (p1 - p0)
    return None


def markdown_rows(rows: list[dict]) -> str:
    out = []
    for c in sorted({r["capacity"] for r in rows}):
        rs = [r for r in rows if r["capacity"] == c]
        cks = list(dict.fromkeys(r["checkpoint"] for r in rs))
        rs.sort(key=lambda r: (cks.index(r["checkpoint"]), r["prefetch"], r["policy"] != "original+lru",
                               r["policy"] != "original+gamma", r["lam"]))
        ref = next(r for r in rs if r["checkpoint"] == "base" and r["policy"] == "original+lru")
        out.append(f"\n**{ref['model']}, C = {c}**: {ref['sequences']} held-out sequences × {ref['seq']} tokens, "
                   "caches reset per sequence; transfers = (demand misses + prefetch loads) / (tokens · layers)\n")
        out.append("| checkpoint | recipe | policy | ppl | Δppl vs base+LRU | transfers / token / layer | "
                   "× fewer than base+LRU | prefetch loads / token / layer | net vs same ckpt + LRU | "
                   "predictor / prior recall |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            rec = r.get("recipe") or {}
            recipe = ("–" if not rec else f"{rec.get('preset')} λ_cs {rec.get('lambda_cs')} λ_rm {rec.get('lambda_rm')} "
                      f"{rec.get('steps')} × {rec.get('seq_len')} tokens lr {rec.get('lr'):g}")
            pf = r["prefetched"] / (r["tokens"] * r["layers"])
            net = f"{r['net_transfers_per_token_layer']:+.3f}" if "net_transfers_per_token_layer" in r else ""
            rec_s = (f"{r['predictor_recall']:.3f} / {r['prior_recall']:.3f}" if "predictor_recall" in r else "")
            out.append(f"| {r['checkpoint']} | {recipe} | {r['policy']} | {r['ppl']:.2f} | "
                       f"{100 * (r['ppl'] / ref['ppl'] - 1):+.1f} % | {r['transfers_per_token_layer']:.3f} | "
                       f"{ref['transfers_per_token_layer'] / r['transfers_per_token_layer']:.2f}× | {pf:.3f} | {net} | "
                       f"{rec_s} |")
        out.append("")
        hits = [r for r in rs if r["checkpoint"] != "base" and r["ppl"] <= 1.02 * ref["ppl"]
                and r["transfers_per_token_layer"] * 2 <= ref["transfers_per_token_layer"]]
        out.append(f"Target (fine-tuned, ≤ +2 % ppl, ≥ 2× fewer transfers than base+LRU): "
                   + (", ".join(f"{r['checkpoint']} {r['policy']}" for r in hits) if hits else "**none**"))
        out.append("\nEach fine-tuned point against base + Cache-Prior at the same perplexity (its λ curve, interpolated):\n")
        for r in rs:
            if r["checkpoint"] == "base" or r["prefetch"]:
                continue
            bt = base_transfers_at(rows, c, r["ppl"])
            out.append(f"- {r['checkpoint']} {r['policy']} at ppl {r['ppl']:.2f}: {r['transfers_per_token_layer']:.3f}; "
                       + (f"base + Cache-Prior at that ppl: {bt:.3f} ({'fine-tuned lower' if r['transfers_per_token_layer'] < bt else 'base lower'})"
                          if bt is not None else "beyond the base + Cache-Prior curve's ppl range"))
    return "\n".join(out)


def plot_frontier(rows: list[dict], path: str) -> Path:
    """ppl against transfers per token per layer, one panel per C: base + Cache-Prior's curve (λ = 0 is base +
    LRU), each fine-tuned checkpoint's LRU → Cache-Prior curve, its γ-cache and predictor-prefetch points."""
    from expertcache.results import pyplot, save_figure

    plt = pyplot()
    caps = sorted({r["capacity"] for r in rows})
    fig, axes = plt.subplots(1, len(caps), figsize=(9.6 * len(caps), 5.0), squeeze=False)
    for ax, c in zip(axes[0], caps):
        rs = [r for r in rows if r["capacity"] == c]
        ref = next(r for r in rs if r["checkpoint"] == "base" and r["policy"] == "original+lru")
        for i, ck in enumerate(dict.fromkeys(r["checkpoint"] for r in rs)):
            color = "k" if ck == "base" else f"C{i}"
            cur = sorted((r["lam"], r["transfers_per_token_layer"], r["ppl"]) for r in rs
                         if r["checkpoint"] == ck and r["eviction"] == "lru" and not r["prefetch"])
            rec = next((r.get("recipe") for r in rs if r["checkpoint"] == ck), None) or {}
            label = ("base + Cache-Prior (λ 0 → max), training-free" if ck == "base"
                     else f"{ck}: {rec.get('preset', '?')} λ_cs {rec.get('lambda_cs')} λ_rm {rec.get('lambda_rm')} "
                          f"{rec.get('seq_len')}-token windows, {rec.get('steps')} steps + LRU → Cache-Prior")
            ax.plot([t for _, t, _ in cur], [p for _, _, p in cur], "-o", color=color, ms=4, lw=1.6 if ck == "base"
                    else 1.1, label=label)
            for lam, t, p in cur:
                if lam:
                    ax.annotate(f"{lam:g}", (t, p), fontsize=6, color=color, xytext=(2, 2), textcoords="offset points")
            for pol, marker, name in (("original+gamma", "s", "γ cache"), ("original+lru+prefetch", "^", "prefetch")):
                pt = next((r for r in rs if r["checkpoint"] == ck and r["policy"] == pol), None)
                if pt is not None:
                    ax.plot(pt["transfers_per_token_layer"], pt["ppl"], marker, color=color, mfc="none", ms=7,
                            label=f"{ck} + {name}")
        ax.axhline(ref["ppl"] * 1.02, ls=":", color="grey", lw=0.8)
        ax.axvline(ref["transfers_per_token_layer"] / 2, ls=":", color="grey", lw=0.8)
        ax.text(ref["transfers_per_token_layer"] / 2, ref["ppl"] * 1.02, " target: ≤ +2 % ppl, ≥ 2× fewer",
                fontsize=7, color="grey", va="bottom")
        ax.set_xlabel("transfers / token / layer (demand misses + prefetch loads)")
        ax.set_ylabel("held-out perplexity")
        ax.set_title(f"{ref['model']}, C = {c}: {ref['sequences']} × {ref['seq']}-token held-out sequences",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return save_figure(fig, path, dpi=120)


def markdown(path: str) -> str:
    """Markdown tables from a results JSONL."""
    return markdown_rows([json.loads(l) for l in open(path) if l.strip()])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if len(sys.argv) == 3 and sys.argv[1] == "--markdown":
        print(markdown(sys.argv[2]))
        sys.exit(0)
    if len(sys.argv) == 5 and sys.argv[1] == "--plot":  # --plot ROWS.jsonl --figure OUT.png
        plot_frontier([json.loads(l) for l in open(sys.argv[2]) if l.strip()], sys.argv[4])
        sys.exit(0)
    sys.exit(main())

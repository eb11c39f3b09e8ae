"""Budget-targeted routing, closed loop on held-out text: achieved vs target miss rate over time, and
perplexity at the achieved miss rate against the best fixed strength reaching the same miss rate.

    python benchmarks/budget_report.py --tokens 4096 --out docs/results/budget

writes ``budget.jsonl`` (one row per run: fixed strengths and controlled targets), ``budget.md`` (tables) and
``budget-<policy>-C<cap>.png`` (running miss rate / target vs tokens) into --out. Model: the shipped
``granular`` (N = 32, K = 8, 4 MoE layers); text: the first --tokens of the corpus's held-out split, in
256-token chunks with caches carried across chunks (one stream). ERAS-bias's activation profile comes from the
shipped WikiText-2 trace (another text).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="granular")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--capacity", default="0.5,0.25")
    ap.add_argument("--policies", default="cache-prior,eras-bias")
    ap.add_argument("--targets", default="0.25,0.5,0.75", help="targets as fractions of the original miss rate")
    ap.add_argument("--out", default="docs/results/budget")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from expertcache.assets import shipped_model_dir  # noqa: F401  (shipped assets present)
    from expertcache.eval import load_model_and_tokenizer
    from expertcache.eval.budget import calibrate_strength, fixed_at, heldout_tokens, stream_eval
    from expertcache.routing import RoutingConfig
    from expertcache.sim import activation_frequency
    from expertcache.trace import RoutingTrace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_model_and_tokenizer(args.model)
    toks = heldout_tokens(tok, args.tokens)
    trace_path = Path(__file__).resolve().parents[1] / "src/expertcache/assets/traces/granular-wikitext2.trace.safetensors"
    tr = RoutingTrace.load(trace_path)
    freq = activation_frequency(tr.ids_TLK, tr.meta.num_experts)
    grids = {"cache-prior": [0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0],
             "eras-bias": [0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}
    name = {"cache-prior": "lam", "eras-bias": "beta"}
    rows = []
    md = ["# Budget-targeted routing: closed loop on held-out text", "",
          f"Model `{args.model}`, {args.tokens} held-out tokens (256-token chunks, caches carried), LRU. "
          "Controller: one strength for all layers, integral control on log strength (defaults of `ControllerConfig`), "
          "started at the strength the simulator gives for the target on the first 2048 tokens of the shipped "
          "WikiText-2 trace (another text; open loop). "
          "`fixed ppl @ same miss` = the lower convex hull of the fixed-strength runs (miss rate, log ppl) at the "
          "controller's achieved miss rate (a mix of the two neighbouring fixed strengths reaches it).", ""]
    for cap in [float(c) for c in args.capacity.split(",")]:
        for pol in args.policies.split(","):
            fz = freq if pol == "eras-bias" else None
            fixed = []
            for s in grids[pol]:
                r = stream_eval(model, toks, RoutingConfig(pol, **{name[pol]: s}), capacity=cap, freq_LE=fz)
                r.update(kind="fixed", strength_value=s, capacity_fraction=cap)
                rows.append(r)
                fixed.append(r)
                print(f"C={cap} {pol} {name[pol]}={s}: miss {r['miss_rate']:.4f} ppl {r['ppl']:.3f}", file=sys.stderr)
            base = fixed[0]["miss_rate"]
            table = [f"## {pol}, C = {cap:g}·N ({fixed[0]['capacity']} of 32 experts)", "",
                     f"Original routing: miss rate {base:.4f}, ppl {fixed[0]['ppl']:.3f}. Fixed {name[pol]}: " +
                     ", ".join(f"{f['strength_value']:g} → {f['miss_rate']:.4f} / {f['ppl']:.2f}" for f in fixed), "",
                     "| target | achieved (all) | running @256 / target | @512 | @1024 | start (sim) → final strength | ppl | fixed ppl @ same miss | Δ |",
                     "|---|---|---|---|---|---|---|---|---|"]
            curves = []
            for frac in [float(x) for x in args.targets.split(",")]:
                target = round(base * frac, 4)
                s0 = calibrate_strength(tr, pol, cap, target, freq_LE=fz, tokens=2048)
                r = stream_eval(model, toks, RoutingConfig(pol), capacity=cap, target=target, freq_LE=fz,
                                controller_kw=dict(s0=s0))
                r["calibrated_s0"] = s0
                ref = fixed_at([(f["miss_rate"], f["ppl"]) for f in fixed], r["miss_rate"])
                r.update(kind="controlled", capacity_fraction=cap, target_fraction=frac, fixed_ppl_same_miss=ref)
                run = r["running_miss_rate"]
                at = {n: run[n - 1] / target for n in (256, 512, 1024) if n <= len(run)}
                strengths_TL = r.pop("strengths_TL")
                r["strength_trajectory"] = [row[0] for row in strengths_TL][::16]
                rows.append(r)
                curves.append((target, run))
                delta = "" if ref is None else f"{100 * (r['ppl'] / ref - 1):+.2f} %"
                table.append(f"| {target:.4f} ({frac:g}×) | {r['miss_rate']:.4f} | {at.get(256, float('nan')):.3f} | "
                             f"{at.get(512, float('nan')):.3f} | {at.get(1024, float('nan')):.3f} | "
                             f"{s0:.3g} → {r['controller']['strengths'][0]:.3g} | {r['ppl']:.3f} | "
                             f"{'—' if ref is None else f'{ref:.3f}'} | {delta} |")
                print(f"C={cap} {pol} target {target}: achieved {r['miss_rate']:.4f} @256 {at.get(256)} ppl "
                      f"{r['ppl']:.3f} fixed {ref}", file=sys.stderr)
            md += table + [""]
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt

                fig, ax = plt.subplots(figsize=(6, 3.5))
                for target, run in curves:
                    ax.plot(np.arange(1, len(run) + 1), np.asarray(run) / target, label=f"target {target:.4f}")
                ax.axhspan(0.9, 1.1, color="grey", alpha=0.2, label="±10 %")
                ax.axvline(256, color="k", lw=0.8, ls=":")
                ax.set_xscale("log")
                ax.set_ylim(0, 3)
                ax.set_xlabel("tokens")
                ax.set_ylabel("running miss rate / target")
                ax.set_title(f"{pol}, C = {cap:g}·N, granular, held-out text")
                ax.legend(fontsize=7)
                fig.tight_layout()
                png = out / f"budget-{pol}-C{cap:g}.png"
                fig.savefig(png.with_suffix(".tmp.png"), dpi=110)
                os.replace(png.with_suffix(".tmp.png"), png)
                plt.close(fig)
                md.append(f"![{pol} C={cap:g}]({png.name})")
                md.append("")
            except ImportError:
                pass
    tmp = out / "budget.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    os.replace(tmp, out / "budget.jsonl")
    tmp = out / "budget.md.tmp"
    tmp.write_text("\n".join(md) + "\n")
    os.replace(tmp, out / "budget.md")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())

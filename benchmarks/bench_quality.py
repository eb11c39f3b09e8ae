"""Quality against miss rate, closed loop: the lowest miss rate each routing policy reaches within a perplexity
budget (+1 % and +5 % over original routing), per model and cache size, read from `expertcache sweep` rows.

The rows come from closed-loop sweeps of the shipped models on WikiText-2 test (4 chunks of 256 tokens, LRU,
caches carried across chunks), every policy on an 11-point strength grid, C = N/2 and N/4 (step 8 of
benchmarks/make_figures.sh runs them):

    expertcache sweep --model granular --task wikitext --limit 4 --grid 11 --capacity 0.5,0.25 \\
        --policies original,prune,max-rank,cumsum,cache-prior,eras-threshold,eras-bias --freq-from TRACE \\
        --out docs/results/closed-loop-granular-wikitext-all-policies.jsonl          # likewise --model coarse
    python benchmarks/bench_quality.py docs/results/closed-loop-{granular,coarse}-wikitext-all-policies.jsonl

Prints one markdown table per rows file; ``--out`` appends one JSONL row per (model, C, policy, budget) with the
chosen run's full configuration. One run per point: differences of a few tenths of a percent of perplexity are
within the noise of 1024 tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

POLICIES = ("original", "prune", "max-rank", "cumsum", "cache-prior", "eras-threshold", "eras-bias")
STRENGTH = {"prune": ("h", "h"), "max-rank": ("m", "M"), "cumsum": ("p", "p"), "cache-prior": ("lam", "λ"),
            "eras-threshold": ("alpha", "α"), "eras-bias": ("beta", "β")}
BUDGETS = (0.01, 0.05)


def best_within(rows: list[dict], policy: str, ppl_max: float) -> dict | None:
    """The run of ``policy`` with the lowest miss rate among those with perplexity <= ``ppl_max`` (None if none)."""
    ok = [r for r in rows if r["config"]["routing"]["policy"] == policy and r["quality"] <= ppl_max]
    return min(ok, key=lambda r: (r["miss_rate"], r["quality"])) if ok else None


def tables(rows: list[dict]) -> tuple[str, list[dict]]:
    """Markdown table (one line per policy, one column pair per cache size) and the chosen rows."""
    model = rows[0]["config"]["model"]
    n = rows[0]["config"]["num_experts"]
    caps = sorted({r["config"]["capacity"] for r in rows}, reverse=True)
    head = "| policy | " + " | ".join(f"C = {c} of {n}: ≤ +{b:.0%} ppl" for c in caps for b in BUDGETS) + " |"
    lines = [head, "|---|" + "---|" * (len(caps) * len(BUDGETS))]
    chosen: list[dict] = []
    cells: dict[str, list[str]] = {p: [] for p in POLICIES}
    for c in caps:
        rs = [r for r in rows if r["config"]["capacity"] == c]
        base = [r for r in rs if r["config"]["routing"]["policy"] == "original"]
        if not base:
            raise SystemExit(f"bench_quality.py: no original-routing run at C = {c} for {model}")
        m0, q0 = base[0]["miss_rate"], base[0]["quality"]
        for p in POLICIES:
            for b in BUDGETS:
                r = best_within(rs, p, q0 * (1 + b))
                if r is None:
                    cells[p].append("–")
                    continue
                key, sym = STRENGTH.get(p, (None, None))
                s = f", {sym} = {r['config']['routing'][key]:g}" if key else ""
                change = f" ({r['miss_rate'] / m0 - 1:+.0%}{s})" if p != "original" else f" (ppl {q0:.1f})"
                cells[p].append(f"{r['miss_rate']:.2%}{change}")
                chosen.append(dict(bench="quality", model=model, capacity=c, policy=p, ppl_budget=b,
                                   miss_rate=r["miss_rate"], ppl=r["quality"], original_miss_rate=m0,
                                   original_ppl=q0, belady_miss_rate=r["belady_miss_rate"], config=r["config"]))
    lines += [f"| {p} | " + " | ".join(cells[p]) + " |" for p in POLICIES if any(x != "–" for x in cells[p])]
    return f"**{model}** (N = {n}, K = {rows[0]['config']['top_k']})\n\n" + "\n".join(lines), chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Example: python benchmarks/bench_quality.py "
                                        "docs/results/closed-loop-granular-wikitext-all-policies.jsonl")
    ap.add_argument("rows", nargs="+", help="JSONL rows of `expertcache sweep` (closed loop, one model per file)")
    ap.add_argument("--out", default=None, help="append the chosen runs as JSONL rows to this file")
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    from expertcache.results import append_jsonl, read_jsonl

    for path in args.rows:
        if not Path(path).is_file():
            print(f"bench_quality.py: rows file not found: {path}", file=sys.stderr)
            return 2
    for path in args.rows:
        rows = [r for r in read_jsonl(path) if r.get("kind") == "eval" and "quality" in r]
        if not rows:
            print(f"bench_quality.py: no closed-loop sweep rows in {path}", file=sys.stderr)
            return 2
        md, chosen = tables(rows)
        print(md + "\n")
        if args.out:
            for row in chosen:
                append_jsonl(args.out, dict(row, rows=str(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tables and the frontier figure of BENCHMARKS.md's "Mixed precision: serving a miss at 4 bits" from the rows
of ``benchmarks/bench_mixed.py`` (benchmarks/results/mixed.jsonl).

    python benchmarks/mixed_report.py [--rows benchmarks/results/mixed.jsonl] [--figure docs/figures/mixed-frontier.png]

Prints the quality tables (per model and text -- WikiText-2 test, the project's held-out split -- at C = N/4:
perplexity and the three counters per token and MoE layer, against bf16 original + LRU), the MMLU tables
(accuracy ± standard error, log-probability of the right letter, answers changed against original + LRU) and
the speed table (OLMoE shape in a memory cgroup: medians of tok/s, ratios against bf16
+ Cache-Prior of the same rounds), and draws perplexity (quality rows) against tok/s (speed rows) for every
configuration present in both (the same names: the same rule and routing).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from expertcache.jsonsafe import loads
from expertcache.results import pyplot, save_figure

ROOT = Path(__file__).resolve().parent
ROWS = ROOT / "results" / "mixed.jsonl"
FIGURE = ROOT.parent / "docs" / "figures" / "mixed-frontier.png"


def read_rows(path: Path) -> list[dict]:
    return [loads(line, what=str(path)) for line in path.read_text().splitlines() if line.strip()]


def dataset_of(row: dict) -> str:
    """The text a quality row scored: ``wikitext`` (rows written before the field existed) or ``heldout``."""
    return row.get("dataset", "wikitext")


def latest_runs(rows: list[dict], kind: str) -> dict[tuple[str, str], list[dict]]:
    """(model, dataset) -> its rows of ``kind`` from the latest run (by date)."""
    out = {}
    rs = [r for r in rows if r.get("kind") == kind]
    for key in dict.fromkeys((r["model"], dataset_of(r)) for r in rs):
        mine = [r for r in rs if (r["model"], dataset_of(r)) == key]
        last = max(r["date"] for r in mine)
        out[key] = [r for r in mine if r["date"] == last]
    return out


def quality_runs(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(model, dataset) -> its perplexity rows of the latest run."""
    return latest_runs(rows, "mixed-quality")


def speed_run(rows: list[dict]) -> list[dict]:
    """Every speed row at the latest row's setting (layers, cgroup fraction, memory): runs with the same
    setting pool their rounds (each run interleaves its configurations)."""
    rs = [r for r in rows if r.get("kind") == "mixed-speed"]
    if not rs:
        return []
    key = lambda r: (r["layers"], r["fraction"], r["memory"] if r["memory"] == "auto" else 0)  # noqa: E731
    last = key(max(rs, key=lambda r: r["date"]))
    return [r for r in rs if key(r) == last]


def paired_se(row: dict, base: dict) -> float | None:
    """Standard error of ``row``'s log-perplexity minus ``base``'s over their chunks (each chunk's mean NLL
    difference one sample: the rows score the same chunks), None for rows without per-chunk NLLs or one chunk.
    ± this, as a percentage, is the resolution of the "vs bf16 original+LRU" column."""
    a, b = row.get("chunk_nll"), base.get("chunk_nll")
    if not a or not b or len(a) < 2 or len(a) != len(b):
        return None
    per = row["tokens"] / len(a)
    return statistics.stdev((x - y) / per for x, y in zip(a, b)) / math.sqrt(len(a))


def quality_table(rows: list[dict]) -> str:
    """Perplexity and the three counters per token and MoE layer against bf16 original + LRU; with per-chunk NLLs
    (rows since the field exists) the change's paired standard error (:func:`paired_se`) beside it."""
    base = next(r for r in rows if r["name"] == "bf16 original+LRU")
    text = {"wikitext": "WikiText-2", "heldout": "held-out split"}.get(dataset_of(base), dataset_of(base))
    chunks = len(base.get("chunk_nll") or ())
    size = f"{chunks} × {base['tokens'] // chunks + 1} tokens, " if chunks else ""
    se_head = " (± paired SE over chunks)" if chunks > 1 else ""
    lines = [f"| configuration ({base['model']}, {text}, {size}C = {base['capacity']}/{base['num_experts']}) | "
             f"perplexity | vs bf16 original+LRU{se_head} | full-precision hits | int4 computes | loads | loads vs "
             "original+LRU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        se = None if r is base else paired_se(r, base)
        pm = "" if se is None else f" ± {100 * se:.2f}"
        lines.append(f"| {r['name']} | {r['ppl']:.2f} | {100 * (r['ppl'] / base['ppl'] - 1):+.2f}{pm} % | "
                     f"{r['fp_hits_per_token_layer']:.2f} | {r['low_per_token_layer']:.2f} | "
                     f"{r['loads_per_token_layer']:.2f} | {100 * (r['loads'] / base['loads'] - 1):+.0f} % |")
    return "\n".join(lines)


def mmlu_table(rows: list[dict]) -> str:
    """Accuracy ± its binomial standard error, the mean log-probability of the right letter, and the questions
    whose predicted letter differs from bf16 original + LRU's (the rows score the same questions: a paired
    comparison, finer than two accuracies' standard errors)."""
    base = next(r for r in rows if r["name"] == "bf16 original+LRU")
    lines = [f"| configuration ({base['model']}, MMLU {base['questions']} questions, {base['shots']}-shot cut to "
             f"{base['context']} tokens: {base['mean_shots']:.1f} exemplars, C = {base['capacity']}/"
             f"{base['num_experts']}) | accuracy | log p(right letter) | answers ≠ original+LRU | "
             "full-precision hits | int4 computes | loads | loads vs original+LRU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        flips = sum(a != b for a, b in zip(r["predictions"], base["predictions"]))
        lines.append(f"| {r['name']} | {r['accuracy']:.3f} ± {r['se']:.3f} | {r['mean_answer_loglik']:.3f} | "
                     f"{flips} | {r['fp_hits_per_token_layer']:.2f} | {r['low_per_token_layer']:.2f} | "
                     f"{r['loads_per_token_layer']:.2f} | {100 * (r['loads'] / base['loads'] - 1):+.0f} % |")
    return "\n".join(lines)


def speed_name(row: dict) -> str:
    """A speed row's configuration, with its dense part where that is quantised (``--dense``)."""
    dense = row.get("dense", "none")
    return row["name"] + ("" if dense == "none" else f", dense {dense}")


def speed_medians(rows: list[dict]) -> dict[str, dict]:
    ok = [r for r in rows if "tok_s" in r]
    out = {}
    for name in dict.fromkeys(speed_name(r) for r in rows):
        rs = [r for r in ok if speed_name(r) == name]
        failed = [r for r in rows if speed_name(r) == name and "tok_s" not in r]
        if not rs:
            out[name] = dict(failed=failed[0].get("error", "failed"))
            continue
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        cpu = [r["cpu_s_per_token"] for r in rs if "cpu_s_per_token" in r]
        out[name] = dict(tok_s=med("tok_s"), capacity=rs[0]["capacity"], loads=med("loads_per_token"),
                         cpu_ms=1e3 * statistics.median(cpu) if cpu else None,
                         low=med("low_computes_per_token"), hits=med("fp_hits_per_token"),
                         mib=med("bytes_per_token") / 2**20, n=len(rs), tok_s_rounds=[r["tok_s"] for r in rs])
    return out


def speed_table(rows: list[dict]) -> str:
    med = speed_medians(rows)
    base = med.get("bf16 Cache-Prior", {}).get("tok_s")
    r0 = next(r for r in rows)
    lines = [f"| configuration ({r0['layers']} layers, cgroup {r0['limit'] / 2**30:.2f} GiB = {r0['fraction']:g} × bf16, "
             f"--memory {_memory(r0['memory'])}) | C | tok/s (median) | × bf16 Cache-Prior | full-precision "
             "hits/token | int4 computes/token | loads/token | MiB read/token | CPU ms/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in med.items():
        if "failed" in m:
            lines.append(f"| {name} | – | did not run: {m['failed']} | | | | | | |")
            continue
        ratio = f"{m['tok_s'] / base:.2f}" if base else "–"
        cpu = "–" if m["cpu_ms"] is None else f"{m['cpu_ms']:.0f}"
        lines.append(f"| {name} | {m['capacity']} | {m['tok_s']:.2f} | {ratio} | {m['hits']:.1f} | {m['low']:.1f} | "
                     f"{m['loads']:.1f} | {m['mib']:.0f} | {cpu} |")
    return "\n".join(lines)


def _memory(memory) -> str:
    return "auto" if memory == "auto" else f"{memory / 2**30:.2f} GiB"


def _colour(name: str) -> str:
    return "black" if name.startswith("bf16") else ("tab:red" if name == "all-int4" else
                                                   "tab:purple" if "Cache-Prior" in name or "cost" in name else "tab:orange")


def figure(quality: list[dict], speed: list[dict], path: Path) -> Path | None:
    """Left: perplexity against full-precision loads per token and MoE layer (every quality row). Right: perplexity
    against the OLMoE-shape tok/s of the configurations present in both."""
    med = speed_medians(speed)
    ppl = {r["name"]: r["ppl"] for r in quality}
    both = [n for n in med if "tok_s" in med[n] and n in ppl]
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for r in quality:
        left.scatter(r["loads_per_token_layer"], r["ppl"], color=_colour(r["name"]), zorder=3)
        left.annotate(r["name"], (r["loads_per_token_layer"], r["ppl"]), textcoords="offset points", xytext=(4, 3),
                      fontsize=7)
    left.set_xlabel(f"full-precision loads per token and MoE layer ({quality[0]['model']}, C = N/4)")
    left.set_ylabel(f"WikiText perplexity, {quality[0]['model']}, C = N/4 (closed loop)")
    left.set_title("quality: int4 computes replace loads")
    for n in both:
        right.scatter(med[n]["tok_s"], ppl[n], color=_colour(n), zorder=3)
        right.annotate(n, (med[n]["tok_s"], ppl[n]), textcoords="offset points", xytext=(4, 3), fontsize=7)
    if both:
        r0 = next(r for r in speed if "tok_s" in r)
        right.set_xlabel(f"decode tok/s (median), OLMoE-1B-7B shape, {r0['layers']} layers, "
                         f"cgroup {r0['fraction']:g} × bf16")
    right.set_title("speed (OLMoE shape) against quality (granular)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=str(ROWS))
    ap.add_argument("--figure", default=str(FIGURE))
    args = ap.parse_args(argv)
    rows = read_rows(Path(args.rows))
    runs, mmlu, speed = quality_runs(rows), latest_runs(rows, "mixed-mmlu"), speed_run(rows)
    for quality in runs.values():
        print(quality_table(quality) + "\n")
    for scored in mmlu.values():
        print(mmlu_table(scored) + "\n")
    if speed:
        print(speed_table(speed) + "\n")
    if runs:
        wiki = {model: r for (model, dataset), r in runs.items() if dataset == "wikitext"} or \
            {model: r for (model, _), r in runs.items()}
        print(f"figure: {figure(wiki.get('granular') or next(iter(wiki.values())), speed, Path(args.figure))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

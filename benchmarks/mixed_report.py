"""Tables and the frontier figure of BENCHMARKS.md's "Mixed precision: serving a miss at 4 bits" from the rows
of ``benchmarks/bench_mixed.py`` (benchmarks/results/mixed.jsonl).

    python benchmarks/mixed_report.py [--rows benchmarks/results/mixed.jsonl] [--figure docs/figures/mixed-frontier.png]

Prints the quality table (granular, C = N/4: perplexity and the three counters per token and MoE layer, against
bf16 original + LRU) and the speed table (OLMoE shape in a memory cgroup: medians of tok/s, ratios against bf16
+ Cache-Prior of the same rounds), and draws perplexity (quality rows) against tok/s (speed rows) for every
configuration present in both (the same names: the same rule and routing).
"""

from __future__ import annotations

import argparse
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


def quality_runs(rows: list[dict]) -> dict[str, list[dict]]:
    """model -> its quality rows of the latest run (by date)."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in rows if r.get("kind") == "mixed-quality"):
        rs = [r for r in rows if r.get("kind") == "mixed-quality" and r["model"] == model]
        last = max(r["date"] for r in rs)
        out[model] = [r for r in rs if r["date"] == last]
    return out


def speed_run(rows: list[dict]) -> list[dict]:
    """Every speed row at the latest row's setting (layers, cgroup fraction, memory): runs with the same
    setting pool their rounds (each run interleaves its configurations)."""
    rs = [r for r in rows if r.get("kind") == "mixed-speed"]
    if not rs:
        return []
    key = lambda r: (r["layers"], r["fraction"], r["memory"] if r["memory"] == "auto" else 0)  # noqa: E731
    last = key(max(rs, key=lambda r: r["date"]))
    return [r for r in rs if key(r) == last]


def quality_table(rows: list[dict]) -> str:
    base = next(r for r in rows if r["name"] == "bf16 original+LRU")
    lines = [f"| configuration ({base['model']}, C = {base['capacity']}/{base['num_experts']}) | perplexity | vs bf16 "
             "original+LRU | full-precision hits | int4 computes | loads | loads vs original+LRU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['ppl']:.2f} | {100 * (r['ppl'] / base['ppl'] - 1):+.2f} % | "
                     f"{r['fp_hits_per_token_layer']:.2f} | {r['low_per_token_layer']:.2f} | "
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
    runs, speed = quality_runs(rows), speed_run(rows)
    for quality in runs.values():
        print(quality_table(quality) + "\n")
    if speed:
        print(speed_table(speed) + "\n")
    if runs:
        print(f"figure: {figure(runs.get('granular') or next(iter(runs.values())), speed, Path(args.figure))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

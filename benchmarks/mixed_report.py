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


def latest(rows: list[dict], kind: str) -> list[dict]:
    """The rows of ``kind`` from the latest run (its date)."""
    rs = [r for r in rows if r.get("kind") == kind]
    if not rs:
        return []
    last = max(r["date"] for r in rs)
    return [r for r in rs if r["date"] == last]


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


def speed_medians(rows: list[dict]) -> dict[str, dict]:
    ok = [r for r in rows if "tok_s" in r]
    out = {}
    for name in dict.fromkeys(r["name"] for r in rows):
        rs = [r for r in ok if r["name"] == name]
        failed = [r for r in rows if r["name"] == name and "tok_s" not in r]
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
             f"--memory {r0['memory'] / 2**30:.2f} GiB) | C | tok/s (median) | × bf16 Cache-Prior | full-precision "
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


def figure(quality: list[dict], speed: list[dict], path: Path) -> Path | None:
    med = speed_medians(speed)
    ppl = {r["name"]: r["ppl"] for r in quality}
    both = [n for n in med if "tok_s" in med[n] and n in ppl]
    if not both:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for n in both:
        colour = "black" if n.startswith("bf16") else ("tab:red" if n == "all-int4" else "tab:orange")
        ax.scatter(med[n]["tok_s"], ppl[n], color=colour, zorder=3)
        ax.annotate(n, (med[n]["tok_s"], ppl[n]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    r0 = next(r for r in speed if "tok_s" in r)
    ax.set_xlabel(f"decode tok/s, OLMoE-1B-7B shape, {r0['layers']} layers, memory cgroup {r0['fraction']:g} × bf16")
    ax.set_ylabel(f"WikiText perplexity, {quality[0]['model']}, C = N/4 (closed loop)")
    ax.set_title("Mixed precision: full-precision slots + every expert at int4")
    ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=str(ROWS))
    ap.add_argument("--figure", default=str(FIGURE))
    args = ap.parse_args(argv)
    rows = read_rows(Path(args.rows))
    quality, speed = latest(rows, "mixed-quality"), latest(rows, "mixed-speed")
    if quality:
        print(quality_table(quality) + "\n")
    if speed:
        print(speed_table(speed) + "\n")
    if quality and speed:
        out = figure(quality, speed, Path(args.figure))
        print(f"figure: {out}" if out else "figure: no configuration in both quality and speed rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tables and figures from result rows (JSONL written by eval, sweep, simulate and sensitivity).

- :func:`pareto_front` -- the rows no other row beats on both miss rate (lower) and quality;
- :func:`pareto_markdown` -- the Pareto table per group (mode, source, cache size, eviction);
- :func:`plot_tradeoff` -- quality vs miss rate per policy with Original/LRU and Belady reference points
  (001 Fig. 4 and 9);
- :func:`plot_cache_sizes` -- miss rate vs cache size: LRU, Belady and the best Cache-Prior λ within a
  quality-loss budget (001 Fig. 10);
- :func:`plot_raster` -- hit/miss/resident raster of one layer over tokens of a trace (001 Fig. 7);
- :func:`plot_sensitivity` -- perplexity when dropping or replacing experts by rank (001 Fig. 2).

Quality is whatever the row reports (``quality``, ``quality_name``, ``higher_is_better``): perplexity or
accuracy for closed-loop rows, the ``router_mass`` proxy for open-loop rows (see :mod:`expertcache.eval.sweep`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from expertcache.registries import Field
from expertcache.routing.registry import SPECS, policy_colour
from expertcache.results import pyplot, save_figure
from expertcache.routing import STRENGTH

__all__ = ["group_rows", "pareto_front", "identical_points", "pareto_markdown", "plot_tradeoff", "plot_cache_sizes",
           "plot_raster", "plot_sensitivity", "strength_of", "policy_of", "slug"]

POLICY_COLORS = Field(SPECS, lambda s: policy_colour(s.name))  # routing/registry.py (a live view)


def _routing(row) -> dict[str, Any]:
    c = row.get("config", {})
    return c.get("routing") or row.get("sweep", {}).get("routing") or {"policy": "original"}


def policy_of(row) -> str:
    return _routing(row)["policy"]


def strength_of(row):
    r = _routing(row)
    name = STRENGTH.get(r["policy"])
    return None if name is None else r.get(name)


def _source(row) -> str:
    c = row.get("config", {})
    if row.get("mode") == "closed-loop":
        task = c.get("task", {})
        name = task.get("task") if isinstance(task, dict) else task
        return f"{c.get('model', '')}:{name}"
    trace = c.get("trace")
    if trace:  # the file's name without its suffixes: granular-wikitext2.trace.safetensors -> granular-wikitext2
        return Path(str(trace)).name.split(".")[0]
    return str(c.get("trace_model") or "trace")


def group_rows(rows: Iterable[dict]) -> dict[tuple, list[dict]]:
    """Rows with a quality and a miss rate grouped by (mode, source, capacity, eviction)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("quality") is not None and r.get("miss_rate") is not None and r.get("kind") != "sensitivity":
            c = r.get("config", {})
            groups[(r.get("mode", "?"), _source(r), c.get("capacity"), c.get("eviction"))].append(r)
    return dict(groups)


def _better(a: float, b: float, higher: bool) -> bool:
    return a > b if higher else a < b


def pareto_front(rows: Sequence[dict], *, dedupe: bool = True) -> list[dict]:
    """Rows not dominated by another row: s dominates r iff s.miss_rate ≤ r.miss_rate and s.quality is at least
    as good, with one of the two strictly better. Sorted by miss rate. With ``dedupe`` only the first of several
    runs at exactly the same (miss rate, quality) point is kept (see :func:`identical_points`)."""
    front = []
    seen = set()
    for r in rows:
        higher = r.get("higher_is_better", True)
        if any(s is not r and s["miss_rate"] <= r["miss_rate"] and not _better(r["quality"], s["quality"], higher)
               and (s["miss_rate"] < r["miss_rate"] or _better(s["quality"], r["quality"], higher)) for s in rows):
            continue  # dominated
        point = (r["miss_rate"], r["quality"])
        if dedupe and point in seen:
            continue
        seen.add(point)
        front.append(r)
    return sorted(front, key=lambda r: (r["miss_rate"], -r["quality"] if r.get("higher_is_better", True)
                                        else r["quality"]))


def identical_points(rows: Sequence[dict], row: dict) -> int:
    """How many rows sit at exactly ``row``'s (miss rate, quality) point (itself included)."""
    return sum(1 for r in rows if r["miss_rate"] == row["miss_rate"] and r["quality"] == row["quality"])


def _fmt_q(row) -> str:
    q = row["quality"]
    return f"{q:.4f}" if row.get("quality_name") in ("ppl", "router_mass") else f"{100 * q:.1f}%"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _original(rows: Sequence[dict]) -> dict | None:
    for r in rows:
        if policy_of(r) == "original" and not (r.get("config", {}).get("replace_rank")):
            return r
    return None


def pareto_markdown(groups: dict[tuple, list[dict]]) -> str:
    """Markdown: one Pareto table per group, with the Original/LRU and Belady references above it."""
    out = ["# Pareto fronts", ""]
    for (mode, source, cap, ev), rows in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        n = rows[0].get("config", {}).get("num_experts", "?")
        qn = rows[0].get("quality_name", "quality")
        out.append(f"## {source} — {mode}, cache {cap}/{n}, {ev} ({len(rows)} runs, quality = {qn}, "
                   f"{'higher' if rows[0].get('higher_is_better', True) else 'lower'} is better)")
        out.append("")
        orig = _original(rows)
        if orig is not None:
            out.append(f"Original routing: {qn} {_fmt_q(orig)}, miss rate {_pct(orig['miss_rate'])}, Belady "
                       f"{_pct(orig.get('belady_miss_rate'))}, "
                       f"mean lifetime {orig.get('mean_lifetime') or 0:.1f} tokens.")
            out.append("")
        out.append(f"| policy | strength | top-J | miss rate | Belady (same selections) | {qn} | mean lifetime "
                   f"| runs at this point |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in pareto_front(rows):
            rt = _routing(r)
            s = strength_of(r)
            strength = "" if s is None else f"{STRENGTH[rt['policy']]}={s:g}"
            out.append(f"| {rt['policy']} | {strength} | "
                       f"{rt.get('top_j', '') if rt['policy'] not in ('original', 'prune') else ''} | "
                       f"{_pct(r['miss_rate'])} | {_pct(r.get('belady_miss_rate'))} | {_fmt_q(r)} | "
                       f"{r.get('mean_lifetime') or 0:.1f} | {identical_points(rows, r)} |")
        out.append("")
    return "\n".join(out)


def slug(*parts) -> str:
    """A file-name-safe slug of ``parts``."""
    import re

    return re.sub(r"[^A-Za-z0-9]+", "-", "-".join(str(p) for p in parts)).strip("-").lower()


def plot_tradeoff(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Quality vs miss rate: every run as a faint dot, each policy's own Pareto front as a line, Original/LRU
    (star) and Belady on the original selections (cross, same quality) as references."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    by_policy: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_policy[policy_of(r)].append(r)
    for pol, rs in sorted(by_policy.items()):
        if pol == "original":
            continue
        color = policy_colour(pol)
        ax.scatter([r["miss_rate"] for r in rs], [r["quality"] for r in rs], s=8, alpha=0.3, color=color)
        front = pareto_front(rs)
        ax.plot([r["miss_rate"] for r in front], [r["quality"] for r in front], "-o", ms=3, color=color, label=pol)
    orig = _original(rows)
    if orig is not None:
        ax.scatter([orig["miss_rate"]], [orig["quality"]], marker="*", s=160, color="black", zorder=5,
                   label=f"original ({orig.get('config', {}).get('eviction', 'lru')})")
        if orig.get("belady_miss_rate") is not None:
            ax.scatter([orig["belady_miss_rate"]], [orig["quality"]], marker="X", s=90, color="tab:red", zorder=5,
                       label="original (Belady)")
    ax.set_xlabel("cache miss rate")
    qn = rows[0].get("quality_name", "quality")
    ax.set_ylabel(qn + ("  (lower is better)" if not rows[0].get("higher_is_better", True) else ""))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=130)


def _loss(q: float, ref: float, higher: bool) -> float:
    """Relative quality loss vs the reference (≥ 0 when worse)."""
    if ref == 0:
        return 0.0
    return (ref - q) / abs(ref) if higher else (q - ref) / abs(ref)


def cache_size_curves(rows: Sequence[dict], budgets=(0.01, 0.05, 0.10)) -> dict[str, list[tuple[int, float]]]:
    """{curve: [(capacity, miss rate)]}: 'LRU' and 'Belady' of the original routing, and for each budget the
    lowest Cache-Prior miss rate whose quality loss vs the original at that capacity is within the budget."""
    by_cap: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_cap[r["config"]["capacity"]].append(r)
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for cap in sorted(by_cap):
        rs = by_cap[cap]
        orig = _original(rs)
        if orig is None:
            continue
        curves["original (LRU)"].append((cap, orig["miss_rate"]))
        if orig.get("belady_miss_rate") is not None:
            curves["original (Belady)"].append((cap, orig["belady_miss_rate"]))
        higher = orig.get("higher_is_better", True)
        for b in budgets:
            ok = [r["miss_rate"] for r in rs if policy_of(r) == "cache-prior"
                  and _loss(r["quality"], orig["quality"], higher) <= b + 1e-12]
            if ok:
                curves[f"cache-prior (≤{100 * b:g}% worse)"].append((cap, min(ok)))
    return dict(curves)


def plot_cache_sizes(rows: Sequence[dict], path: str | Path, title: str = "", budgets=(0.01, 0.05, 0.10)) -> Path:
    """Miss rate vs cache size (001 Fig. 10) from rows of one source and eviction (LRU) at several capacities."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    purples = ["#c9b3e6", "#9467bd", "#4b1f7a"]
    pi = 0
    for name, pts in cache_size_curves(rows, budgets).items():
        xs, ys = zip(*pts)
        if name.startswith("cache-prior"):
            ax.plot(xs, ys, "-o", ms=3, color=purples[pi % 3], label=name)
            pi += 1
        else:
            ax.plot(xs, ys, "-s" if "LRU" in name else "--x", ms=4,
                    color="black" if "LRU" in name else "tab:red", label=name)
    k = rows[0].get("config", {}).get("top_k")
    if k:
        ax.axvline(k, color="tab:blue", lw=0.8, alpha=0.5)
    ax.set_xlabel("cache size (experts per layer)")
    ax.set_ylabel("cache miss rate")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=130)


def plot_raster(traces: Sequence[tuple[str, Any]], path: str | Path, *, layer: int = 0, start: int = 0,
                tokens: int = 100, capacity=None, eviction: str = "lru") -> Path:
    """Hit/miss raster (001 Fig. 7) of one MoE layer for ``tokens`` tokens from ``start``, one panel per
    (label, RoutingTrace). The trace's selections are replayed by an ``eviction`` cache of ``capacity`` experts
    (default: the capacity the trace was recorded with, else N/2) from its first token, or from the start of
    ``start``'s sequence if the trace was recorded with ``between_sequences='reset'``, so the cache state at
    ``start`` is the real one. Green hit, red miss, blue resident but unused."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    from expertcache.eval.timeline import layer_raster

    plt = pyplot()
    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 1.0 + 1.6 * len(traces)), squeeze=False)
    cmap = ListedColormap(["white", "#9ecae1", "#2ca02c", "#d62728"])
    for ax, (label, tr) in zip(axes[:, 0], traces):
        m = tr.meta
        cap = capacity or (m.extra.get("patch", {}).get("capacity") if m.extra else None) or max(1, m.num_experts // 2)
        if not 0 <= layer < m.num_layers:
            raise ValueError(f"layer {layer} out of range: the trace has {m.num_layers} MoE layers")
        end = min(start + tokens, tr.num_tokens)
        between = (m.extra or {}).get("patch", {}).get("between_sequences", "carry")
        seq_start = 0 if between == "carry" else max([s for s in (m.sequence_starts or [0]) if s <= start] or [0])
        ev = layer_raster(np.asarray(tr.ids_TLK)[seq_start:end, layer], m.num_experts, cap, eviction=eviction)
        ev = ev[start - seq_start:]
        req = (ev >= 2).sum()
        mr = (ev == 3).sum() / req if req else float("nan")
        ax.imshow(ev.T, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=3,
                  extent=(start - 0.5, end - 0.5, m.num_experts - 0.5, -0.5))
        ax.set_ylabel("expert")
        ax.set_title(f"{label} — layer {layer}, C={cap}/{m.num_experts}, {eviction}: miss rate {100 * mr:.1f}% "
                     f"in this window", fontsize=8)
    axes[-1, 0].set_xlabel("token")
    return save_figure(fig, path, dpi=130)


def plot_sensitivity(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Perplexity vs expert rank (001 Fig. 2): 'drop' (ranks ≥ r dropped = prune h=r-1) and 'replace' (the
    expert at rank r replaced by a random non-top-K expert); dashed line = original routing."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=False)
    base = [r for r in rows if r.get("sensitivity") == "baseline"]
    for ax, kind, label in ((axes[0], "drop", "drop experts ranked ≥ r"),
                            (axes[1], "replace", "replace the expert at rank r")):
        rs = sorted((r for r in rows if r.get("sensitivity") == kind), key=lambda r: r["rank"])
        if rs:
            ax.plot([r["rank"] for r in rs], [r["quality"] for r in rs], "-o", color="tab:purple")
        if base:
            ax.axhline(base[0]["quality"], ls="--", color="black", lw=1, label="original routing")
        ax.set_xlabel("expert rank r (1 = highest router weight)")
        ax.set_ylabel("WikiText perplexity")
        ax.set_yscale("log")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=130)


"""``expertcache report``: Pareto tables and figures from result rows (JSONL)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from expertcache.cli.common import capacity_spec, check_input_file, check_output_path, nonneg_int, positive_int

DESCRIPTION = """\
Turn JSONL result rows (from eval, sweep, simulate --out, sensitivity) into:

  pareto.md                  the non-dominated runs (miss rate vs quality) per group, printed and written
  tradeoff-<group>.png       quality vs miss rate per policy, with Original/LRU and Belady points (001 Fig. 4, 9)
  cache-size-<group>.png     miss rate vs cache size: LRU, Belady, best cache-prior within 1/5/10% quality
                             loss (001 Fig. 10), for groups swept over at least two cache sizes
  raster.png                 with --trace: hit/miss raster of one layer over tokens (001 Fig. 7)
  sensitivity-<model>.png    for rows of `expertcache sensitivity` (001 Fig. 2)

A group is (mode, model:task or trace, cache size, eviction). Open-loop rows use the router_mass proxy as
quality (see `expertcache sweep --help`). Rows repeating a configuration already read (the same sweep key,
or the same kind, config and seed) are counted once (a note on stderr says how many). A file without result
rows (e.g. JSON of something else) is an error naming the file.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="Pareto table and figures from JSONL result rows",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="*", help="JSONL files of result rows")
    p.add_argument("--out-dir", required=True, help="folder for pareto.md and the PNGs")
    p.add_argument("--trace", action="append", default=[], metavar="FILE[=LABEL]",
                   help="a routing trace for the hit/miss raster (repeat for stacked panels)")
    p.add_argument("--layer", type=nonneg_int, default=0, help="raster: MoE layer index (default 0)")
    p.add_argument("--start", type=nonneg_int, default=0, help="raster: first token (default 0)")
    p.add_argument("--tokens", type=positive_int, default=100, help="raster: tokens shown (default 100)")
    p.add_argument("--raster-capacity", type=capacity_spec, default=None,
                   help="raster: cache size (default: the trace's, else N/2)")
    p.add_argument("--prefix", default="", help="prefix of the written file names")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from expertcache.eval.report import (group_rows, pareto_markdown, plot_cache_sizes, plot_raster,
                                         plot_sensitivity, plot_tradeoff, slug)
    from expertcache.outputs import claim_names, record_names
    from expertcache.results import atomic_write_bytes

    out = check_output_path(args.out_dir, "--out-dir", directory=True)
    if "/" in args.prefix or "\\" in args.prefix or args.prefix in (".", ".."):
        raise ValueError(f"--prefix {args.prefix!r}: a file-name prefix, without folders (use --out-dir)")
    for f in args.rows:
        check_input_file(f, "rows file")
    for spec in args.trace:
        check_input_file(spec.partition("=")[0], "--trace")
    rows = load_rows(args.rows)
    if not rows and not args.trace:
        raise ValueError("nothing to report: give JSONL row files and/or --trace")
    if rows and not group_rows(rows) and not any(r.get("kind") == "sensitivity" for r in rows) and not args.trace:
        raise ValueError(f"nothing to report in {', '.join(args.rows)}: the rows have no quality (rows of "
                         "`simulate --out` only have miss rates; use `sweep` for quality vs miss rate)")
    jobs = []  # (file name, write it): every name is known, and claimed, before the first is written
    groups = group_rows(rows)
    pre = args.prefix
    if groups:
        md = pareto_markdown(groups)
        print(md)
        jobs.append((f"{pre}pareto.md", lambda p: (atomic_write_bytes(p, (md + "\n").encode()), p)[1]))
        for (mode, source, cap, ev), rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
            n = rs[0].get("config", {}).get("num_experts", "?")
            jobs.append((f"{pre}tradeoff-{slug(source, mode, f'c{cap}', ev)}.png",
                         lambda p, rs=rs, t=f"{source} ({mode}), cache {cap}/{n}, {ev}": plot_tradeoff(rs, p, title=t)))
        by_source = defaultdict(list)
        for (mode, source, cap, ev), rs in groups.items():
            by_source[(mode, source, ev)].extend(rs)
        for (mode, source, ev), rs in sorted(by_source.items()):
            if len({r["config"]["capacity"] for r in rs}) >= 2:
                jobs.append((f"{pre}cache-size-{slug(source, mode, ev)}.png",
                             lambda p, rs=rs, t=f"{source} ({mode}), {ev}": plot_cache_sizes(rs, p, title=t)))
    sens = defaultdict(list)
    for r in rows:
        if r.get("kind") == "sensitivity":
            sens[str(r["config"].get("model", ""))].append(r)
    for model, rs in sens.items():
        jobs.append((f"{pre}sensitivity-{slug(model)}.png",
                     lambda p, rs=rs, t=f"{model}: WikiText sensitivity to the expert selection":
                     plot_sensitivity(rs, p, title=t)))
    if args.trace:
        from expertcache.trace import RoutingTrace

        traces = []
        for spec in args.trace:
            file, _, label = spec.partition("=")
            traces.append((label or Path(file).name, RoutingTrace.load(file)))
        jobs.append((f"{pre}raster.png", lambda p: plot_raster(traces, p, layer=args.layer, start=args.start,
                                                                tokens=args.tokens, capacity=args.raster_capacity)))
    # a user's file of the same name in --out-dir (or an input: `report d/pareto.md --out-dir d`) is refused
    claim_names(out, [name for name, _ in jobs], "--out-dir", "report", getattr(args, "inputs_read", None))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        for name, write in jobs:
            written.append(write(out / name))
    except BaseException:
        if written:  # what was written is this command's to replace next time; the first error is the one shown
            try:
                record_names(out, [w.name for w in written], "report")
            except OSError:
                pass
        raise
    record_names(out, [w.name for w in written], "report")
    for w in written:
        print(f"wrote {w}")
    return 0


def _row_key(row: dict) -> str:
    """What identifies a run: its sweep key, else its kind, mode, config, seed, task and sensitivity point."""
    if "sweep_key" in row:
        return "sweep:" + str(row["sweep_key"])
    ident = {k: row.get(k) for k in ("kind", "mode", "config", "seed", "task", "sensitivity", "rank")}
    return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


#: the numbers a report reads from a row: (field, lowest, highest); ``null`` is allowed (e.g. no Belady bound)
ROW_NUMBERS = (("miss_rate", 0.0, 1.0), ("belady_miss_rate", 0.0, 1.0), ("quality", -math.inf, math.inf),
               ("mean_lifetime", 0.0, math.inf))


def _check_row_numbers(row: dict, where: str) -> None:
    """ValueError naming ``where`` and the field when a number the report reads is a string, a bool or out of range."""
    for key, lo, hi in ROW_NUMBERS:
        v = row.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= v <= hi and math.isfinite(v)):
            raise ValueError(f"{where}: {key} must be a number in [{lo:g}, {hi:g}], got {json.dumps(v)[:40]}")


def load_rows(files) -> list[dict]:
    """Result rows of the JSONL ``files``, each configuration once. ValueError naming the file (and line) for a
    file that is not UTF-8, holds a line that is not JSON, a line that is not an object, or no result rows."""
    from expertcache.results import read_jsonl

    rows, seen, dropped = [], set(), 0
    for f in files:
        got = list(read_jsonl(f))
        for i, r in enumerate(got, 1):
            if not isinstance(r, dict):
                raise ValueError(f"{f}: row {i} is a JSON {type(r).__name__}, not a result row (an object)")
        for i, r in enumerate(got, 1):
            _check_row_numbers(r, f"{f}: row {i}")
        result = [r for r in got if "miss_rate" in r or r.get("kind") == "sensitivity"]
        if not result:
            raise ValueError(f"{f}: no result rows (expected JSONL rows of eval, sweep, simulate --out or "
                             "sensitivity, each with a miss_rate)")
        for r in result:
            key = _row_key(r)
            if key in seen:
                dropped += 1
                continue
            seen.add(key)
            rows.append(r)
    if dropped:
        print(f"expertcache report: {dropped} row(s) repeat a configuration already read; counted once",
              file=sys.stderr)
    return rows

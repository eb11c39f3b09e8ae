"""``expertcache sensitivity``: how much WikiText perplexity depends on each expert rank (001 Sec. 2.3, Fig. 2)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from expertcache.cli.common import apply_threads, check_output_path, nonneg_int

DESCRIPTION = """\
Closed-loop WikiText perplexity of the model when its expert selection is perturbed by rank
(r = 1 is the expert with the highest router weight):

  drop     r = 2..K: drop every expert ranked >= r (the pruning baseline keeping h = r - 1 experts;
           the kept weights are not renormalised unless the model renormalises)
  replace  r = 1..K: replace the expert at rank r by one drawn uniformly from the experts outside the
           top-K (seeded), weighted by the model's own rule

plus the unperturbed baseline. Rows (kind=sensitivity) go to --out; --fig draws 001 Fig. 2.
"""


def register(sub: argparse._SubParsersAction) -> None:
    from expertcache.cli.eval import add_model_task_args

    p = sub.add_parser("sensitivity", help="perplexity when dropping / randomly replacing experts by rank (001 Fig. 2)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_task_args(p, task_required=False)
    p.add_argument("--mode", default="drop,replace", help="comma-separated: drop, replace (default both)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the random replacements (default 0)")
    p.add_argument("--out", default=None, help="append the rows to this JSONL file")
    p.add_argument("--fig", default=None, help="write the figure to this PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run, row_outputs=("out",))


def run(args: argparse.Namespace) -> int:
    from expertcache.eval import evaluate, prepare
    from expertcache.eval.report import plot_sensitivity
    from expertcache.results import append_jsonl
    from expertcache.routing import RoutingConfig

    check_output_path(args.out, "--out")
    check_output_path(args.fig, "--fig")
    if args.fig and Path(args.fig).suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ValueError(f"--fig {args.fig}: give a .png, .pdf or .svg file name")
    apply_threads(args, getattr(args, "model", None))
    if args.task not in (None, "wikitext"):
        raise ValueError("sensitivity is measured on --task wikitext (perplexity)")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    for m in modes:
        if m not in ("drop", "replace"):
            raise ValueError(f"unknown --mode {m!r}; use drop, replace or both")
    from expertcache.cli.common import device_from_args

    model, _, task = prepare(args.model, "wikitext", data_dir=args.data_dir, limit=args.limit,
                             device=device_from_args(args))
    from expertcache.models import family_for, find_moe_layers

    k = find_moe_layers(model, family_for(model))[0].top_k
    runs = [("baseline", 0, RoutingConfig(), None)]
    if "drop" in modes:
        runs += [("drop", r, RoutingConfig("prune", h=r - 1), None) for r in range(2, k + 1)]
    if "replace" in modes:
        runs += [("replace", r, RoutingConfig(), r) for r in range(1, k + 1)]
    rows = []
    from tqdm import tqdm

    for kind, r, rc, replace in tqdm(runs, desc="sensitivity", unit="run", disable=args.no_progress):
        row = evaluate(model, task, rc, capacity="0.5", seed=args.seed, replace_rank=replace, model_name=args.model)
        row.update(kind="sensitivity", sensitivity=kind, rank=r)
        rows.append(row)
        if args.out:
            append_jsonl(args.out, row)
        print(f"{kind:>8} r={r:<2} ppl {row['quality']:.3f}", file=sys.stdout, flush=True)
    if args.fig:
        plot_sensitivity(rows, args.fig, title=f"{args.model}: WikiText ({len(task)} chunks of {task.info['context']} "
                         f"tokens), K={k}")
        print(f"wrote {args.fig}")
    return 0

"""``expertcache analyze``: activation profiling of a routing trace (003 Fig. 3, 4, 6) and the ERAS profile."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from expertcache.cli.common import check_output_path, int_in, positive_int, seed_int

DESCRIPTION = """\
Profile the expert activations of a routing trace (003 MoE-ERAS section IV-A):

  analysis_frequency.png    per-layer activation frequency [L, E] (share of each layer's selections; Fig. 3)
  analysis_correlation.png  Pearson correlation across tokens of every (layer, expert) pair of router
                            probabilities (or selection indicators, --signal selected) and its [L, L]
                            best-match summary (Fig. 4)
  analysis_distinct.png     mean distinct experts per layer requested by a batch of b tokens (Fig. 6)
  analysis_summary.json     the numbers behind the figures, with the configuration and trace metadata

--profile-out writes the ERAS biasing profile freq [L, E] (.npy or .json), which
`expertcache simulate --policy eras-bias --freq-from FILE` reads.
"""


#: the files ``--out-dir`` receives
OUT_DIR_FILES = ("analysis_frequency.png", "analysis_correlation.png", "analysis_distinct.png", "analysis_summary.json")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("analyze", help="activation profiling of a routing trace; ERAS biasing profile",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", default=None,
                   help="routing trace file (default: the demo trace recorded from the shipped model)")
    p.add_argument("--out-dir", default=None, help="write the figures and analysis_summary.json here")
    p.add_argument("--profile-out", default=None, help="write the ERAS profile freq [L, E] here (.npy or .json)")
    p.add_argument("--signal", choices=("probs", "selected"), default="probs",
                   help="correlate router probabilities (003) or 0/1 selection indicators (default: probs)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="largest batch size for distinct experts (default: 32)")
    p.add_argument("--batch-mode", choices=("random", "consecutive"), default="random",
                   help="batches of random tokens (independent sequences) or consecutive tokens of one sequence "
                   "(default: random)")
    p.add_argument("--samples", type=int_in(1, 100_000, "random batches per size"), default=256, help="random batches per batch size (default: 256)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random batches (default: 0)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from expertcache.analysis import analyze, save_profile
    from expertcache.cli.main import UsageError
    from expertcache.trace import RoutingTrace

    if args.profile_out and Path(args.profile_out).suffix not in (".npy", ".json"):
        raise UsageError(f"--profile-out must end in .npy or .json, got {args.profile_out!r}")
    check_output_path(args.profile_out, "--profile-out")
    check_output_path(args.out_dir, "--out-dir", directory=True)
    if args.out_dir:  # a user's file of one of these names is refused, never replaced
        from expertcache.outputs import claim_names

        claim_names(args.out_dir, OUT_DIR_FILES, "--out-dir", "analyze", getattr(args, "inputs_read", None))
    if args.trace is None:
        from expertcache.trace.demo import demo_trace_path

        args.trace = str(demo_trace_path())
    trace = RoutingTrace.load(args.trace)
    check_batches(args, trace)
    result = analyze(trace, signal=args.signal, max_batch=args.max_batch, batch_mode=args.batch_mode,
                     samples=args.samples, seed=args.seed, progress=sys.stderr.isatty())
    summary = {**result.summary, "trace_file": str(args.trace)}
    written = []
    if args.profile_out:
        meta = {"model": trace.meta.model, "source": trace.meta.source, "top_k": trace.meta.top_k,
                "tokens": trace.num_tokens, "trace_file": str(args.trace)}
        written.append(save_profile(args.profile_out, result.freq_LE, meta=meta))
    if args.out_dir:
        from expertcache.analysis.plots import plot_correlation, plot_distinct, plot_frequency
        from expertcache.results import atomic_write_bytes

        out = Path(args.out_dir)
        m = trace.meta
        name = f"{Path(m.model).name or m.model} ({trace.num_tokens} tokens)"
        written.append(plot_frequency(result.freq_LE, out / "analysis_frequency.png",
                                      title=f"Activation frequency per layer, {name}"))
        written.append(plot_correlation(result.corr_FF, result.layer_corr_LL, trace.num_layers,
                                        out / "analysis_correlation.png",
                                        title=f"Router correlation ({args.signal}), {name}"))
        written.append(plot_distinct(result.distinct_BL, m.num_experts, m.top_k, out / "analysis_distinct.png",
                                     title=f"Distinct experts vs batch size, {name}", mode=args.batch_mode))
        path = out / "analysis_summary.json"
        atomic_write_bytes(path, (json.dumps(summary, indent=1, sort_keys=True, allow_nan=False) + "\n").encode())
        written.append(path)
        from expertcache.outputs import record_names

        record_names(out, OUT_DIR_FILES, "analyze")
    if args.json:
        print(json.dumps(summary, sort_keys=True, allow_nan=False))
    else:
        print_summary(summary, file=sys.stdout)
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return 0


#: the most memory the distinct-experts batches may take (the largest batch size's [samples, b, L, K] ids)
MAX_BATCH_BYTES = 2 << 30
#: the most random batches drawn in all (--samples per batch size, sizes 1..--max-batch): ~1 min on one core
MAX_DRAWS = 1_000_000


def check_batches(args, trace) -> None:
    """Refuse (one line naming the flag) a --max-batch past the trace's tokens -- a batch holds distinct tokens --
    and --samples × --max-batch past :data:`MAX_DRAWS` or :data:`MAX_BATCH_BYTES` (a MemoryError or minutes of
    silence before)."""
    from expertcache.cli.main import UsageError

    t = trace.num_tokens
    if args.max_batch > t:
        raise UsageError(f"--max-batch {args.max_batch}: the trace holds only {t} tokens (a batch is of distinct "
                         f"tokens); give --max-batch ≤ {t}")
    if args.batch_mode != "random":
        return
    if args.samples * args.max_batch > MAX_DRAWS:
        raise UsageError(f"--samples {args.samples} × --max-batch {args.max_batch} random batches: at most "
                         f"{MAX_DRAWS:,} in all (≤ {MAX_DRAWS // args.max_batch} samples at this --max-batch)")
    need = args.samples * args.max_batch * trace.num_layers * (8 * trace.meta.top_k + trace.meta.num_experts + 1)
    if need > MAX_BATCH_BYTES:
        raise UsageError(f"--samples {args.samples} × --max-batch {args.max_batch} would take "
                         f"{need / 2**30:.1f} GiB for the largest batch (at most {MAX_BATCH_BYTES / 2**30:.0f} GiB); "
                         f"lower one of them")


def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def print_summary(s: dict, file=sys.stdout) -> None:
    t, fr, co, di = s["trace"], s["frequency"], s["correlation"], s["distinct_experts"]
    print(f"trace     {s['trace_file']}  ({t['model']}; {t['tokens']} tokens, {t['num_layers']} MoE layers, "
          f"N={t['num_experts']}, K={t['top_k']})", file=file)
    print(f"{'layer':>5} {'max freq':>9} {'max/unif':>9} {'>1/E':>5} {'never':>6} {'top-25%':>8} "
          f"{'r next':>7}", file=file)
    for i in range(t["num_layers"]):
        nxt = co["adjacent_layers"][i] if i < len(co["adjacent_layers"]) else None
        print(f"{i:>5} {_f(fr['max_per_layer'][i]):>9} {_f(fr['max_over_uniform_per_layer'][i], '{:.2f}'):>9} "
              f"{fr['experts_above_uniform_per_layer'][i]:>5} {fr['never_selected_per_layer'][i]:>6} "
              f"{_f(fr['top_quarter_share_per_layer'][i]):>8} {_f(nxt, '{:.2f}'):>7}", file=file)
    print(f"mean cross-layer best-match |r| {_f(co['mean_cross_layer'], '{:.2f}')}   "
          f"(uniform share 1/E = {fr['uniform']:.3f}; top-25% = share of the E/4 most used experts)", file=file)
    mean = di["mean_by_batch"]
    shown = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= len(mean)]
    print("distinct experts per layer (mean over layers) by batch size: "
          + "  ".join(f"b={b}: {_f(mean[b - 1], '{:.1f}')}" for b in shown), file=file)

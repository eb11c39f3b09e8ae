"""``expertcache sweep``: policy × strength × cache size × eviction, open loop on a trace or closed loop on a
model and task; resumable JSONL rows."""

from __future__ import annotations

import argparse
import sys

from expertcache.routing.registry import NEEDS_PROFILE, STRENGTH_RANGES
from expertcache.cache import EVICTION_POLICIES
from expertcache.cli.common import (add_cache_state_args, apply_threads, capacity_list, check_input_file,
                                    check_output_path, csv_of, flag_message, int_in, nonneg_float, nonneg_int, one_of,
                                    positive_int)
from expertcache.routing import POLICIES, RoutingConfig

DESCRIPTION = """\
Sweep routing policies and their strength over cache sizes and eviction policies, appending one JSON row
per run (full config, package version, seed, metrics) to --out. Rows carry a config key: re-running the
same command skips the runs already in the file, so an interrupted sweep resumes.

Open loop (--trace FILE): the simulator re-routes the trace's fixed logits (fast). Quality is a proxy,
router_mass = router probability of the served experts / that of the top-K (1 = original routing).
Closed loop (--model M --task T): the patched model runs the task for every configuration (slow; use --limit).

Grids (001): prune h in 1..K; max-rank M in K..N; cumsum p, cache-prior lambda, eras-threshold alpha at --grid
points in [0, 1]; eras-bias beta in [0, --beta-max]. --strengths replaces the continuous grids.
"""

_DEFAULT_POLICIES = "original,prune,max-rank,cumsum,cache-prior"


def register(sub: argparse._SubParsersAction) -> None:
    from expertcache.cli.eval import add_model_task_args

    p = sub.add_parser("sweep", help="sweep policies x strengths x cache sizes x evictions into JSONL rows",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, help="open loop: routing trace to simulate")
    add_model_task_args(p, task_required=False)
    g = p.add_argument_group("grid")
    g.add_argument("--policies", type=csv_of(one_of(POLICIES, "policy"), "policy"), default=_DEFAULT_POLICIES,
                   help=f"comma-separated policies among {', '.join(POLICIES)} (default: {_DEFAULT_POLICIES})")
    g.add_argument("--grid", type=int_in(1, 10_000, "points of a grid in [0, 1]"), default=50, help="points of the continuous grids in [0, 1] (001: 50)")
    g.add_argument("--strengths", type=csv_of(nonneg_float, "value"), default=None,
                   help="explicit comma-separated values for p / lambda / alpha / beta")
    g.add_argument("--beta-max", type=nonneg_float, default=4.0, help="eras-bias: largest beta (default 4)")
    g.add_argument("--top-j", type=nonneg_int, default=None,
                   help="always keep the original top-J (default: each policy's paper: 1 for max-rank, cumsum, "
                   "cache-prior; 0 for eras-threshold, eras-bias)")
    g.add_argument("--delta", type=nonneg_float, default=None, help="cache-prior: fixed delta (default: running average)")
    g.add_argument("--capacity", type=capacity_list, default="0.5", help="comma-separated cache sizes: counts or fractions of N "
                   "(default 0.5)")
    g.add_argument("--eviction", type=csv_of(one_of(EVICTION_POLICIES, "eviction"), "eviction"), default="lru",
                   help=f"comma-separated evictions among {', '.join(EVICTION_POLICIES)} (default lru)")
    add_cache_state_args(g)
    p.add_argument("--out", required=True, help="JSONL file to append rows to (resumes if it exists; a second sweep "
                   "on the same file is refused while the first runs: lock <out>.lock)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the sweep's runs as Ray tasks (pip install 'expertcache[ray]'): no ADDRESS = a new local "
                   "Ray instance, 'auto' = this node's cluster, ray://HOST:10001 = Ray client; the driver alone "
                   "writes --out (same rows, same resume)")
    p.add_argument("--ray-cpus", type=positive_int, default=None,
                   help="--ray without ADDRESS: CPUs (= parallel runs) of the local Ray instance (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print how many runs are planned and pending, run nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run, row_outputs=("out",))


def run(args: argparse.Namespace) -> int:
    from expertcache.cli.main import UsageError
    from expertcache.eval.sweep import SweepLockedError, sweep_lock

    if bool(args.trace) == bool(args.task):
        raise ValueError("give either --trace FILE (open loop) or --model M --task T (closed loop)")
    check_output_path(args.out, "--out")
    check_input_file(args.trace, "--trace")
    check_input_file(args.freq_from, "--freq-from")
    if args.ray is not None and not args.dry_run:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise UsageError("--ray needs Ray: pip install 'expertcache[ray]'") from None
    if args.dry_run:
        return _run(args)
    try:
        with sweep_lock(args.out):  # before the model loads: a second sweep on the same file fails at once
            return _run(args)
    except SweepLockedError as exc:
        raise UsageError(f"--out {exc}") from None


def _run(args: argparse.Namespace) -> int:
    from expertcache.eval.sweep import closed_loop_row, config_key, done_keys, open_loop_row, plan, run_sweep

    policies = args.policies.split(",")
    strengths = [float(x) for x in args.strengths.split(",")] if args.strengths else None
    common = dict(policies=policies, capacities=args.capacity.split(","), evictions=args.eviction.split(","),
                  points=args.grid, top_j=args.top_j, beta_max=args.beta_max, strengths=strengths, delta=args.delta,
                  gamma=args.gamma, initial=args.initial, seed=args.seed, between_sequences=args.between_sequences)
    progress = not args.no_progress
    apply_threads(args, getattr(args, "model", None))  # tiny per-token ops: extra threads only spin
    if args.trace:
        from expertcache.sim import activation_frequency
        from expertcache.trace import RoutingTrace

        trace = RoutingTrace.load(args.trace)
        m = trace.meta
        runs = _plan(plan, mode="open-loop", source=dict(trace=str(args.trace)), k=m.top_k,
                     num_experts=m.num_experts, **common)
        freq = activation_frequency(trace.ids_TLK, m.num_experts) if any(p in NEEDS_PROFILE for p in policies) else None
        execute = lambda r: open_loop_row(trace, r, freq_LE=freq)  # noqa: E731
    else:
        from expertcache.cli.common import device_from_args
        from expertcache.cli.eval import freq_profile
        from expertcache.eval import prepare
        from expertcache.models import family_for, find_moe_layers

        profiled = [p for p in policies if p in NEEDS_PROFILE]
        freq = freq_profile(args, RoutingConfig(profiled[0])) if profiled else None
        model, _, task = prepare(args.model, args.task, data_dir=args.data_dir, limit=args.limit, shots=args.shots,
                                 max_new_tokens=args.max_new_tokens, device=device_from_args(args))
        layer0 = find_moe_layers(model, family_for(model))[0]
        source = dict(model=str(args.model), task=args.task, limit=args.limit, shots=args.shots,
                      max_new_tokens=args.max_new_tokens if args.task == "gsm8k" else None)
        runs = _plan(plan, mode="closed-loop", source=source, k=layer0.top_k, num_experts=layer0.num_experts,
                     scope=args.scope or task.default_scope, **common)
        execute = lambda r: closed_loop_row(model, task, r, freq_LE=freq, model_name=str(args.model))  # noqa: E731
    if args.dry_run:
        done = done_keys(args.out)
        pending = sum(config_key(r) not in done for r in runs)
        print(f"{len(runs)} runs planned, {pending} pending, {len(runs) - pending} already in {args.out}")
        return 0
    js = {r["routing"]["policy"]: r["routing"]["top_j"] for r in runs}
    print(f"expertcache sweep: {len(runs)} runs; top-J per policy "
          + ", ".join(f"{k} {v}" for k, v in js.items() if k not in ("original", "prune")), file=sys.stderr)
    if args.ray is not None:
        from expertcache.eval import ray_sweep

        if args.trace:
            spec = ray_sweep.open_loop_spec(args.trace, need_freq=any(p in NEEDS_PROFILE for p in policies), threads=args.threads)
        else:
            spec = ray_sweep.closed_loop_spec(model=str(args.model), task=args.task, data_dir=args.data_dir,
                                              limit=args.limit, shots=args.shots,
                                              max_new_tokens=args.max_new_tokens, freq_LE=freq, threads=args.threads)
        executed, skipped = ray_sweep.run_sweep_ray(runs, args.out, spec, address=args.ray, num_cpus=args.ray_cpus,
                                                    progress=progress)
    else:
        executed, skipped = run_sweep(runs, args.out, execute, progress=progress)
    print(f"sweep: {executed} runs appended to {args.out}, {skipped} already there (skipped)", file=sys.stderr)
    return 0


def _plan(plan, **kw):
    """``plan`` with RoutingConfig errors naming the sweep flag (``--strengths``, ``--top-j``, ...)."""
    try:
        return plan(**kw)
    except ValueError as exc:
        msg = flag_message(str(exc), ["top_j", "delta"])
        for name in STRENGTH_RANGES:
            if msg.startswith(name + " "):
                msg = "--strengths / --beta-max: " + msg
        raise ValueError(msg) from None

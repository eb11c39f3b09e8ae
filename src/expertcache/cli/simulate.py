"""``expertcache simulate``: open-loop cache simulation of a routing trace under a policy and a cache."""

from __future__ import annotations

import argparse
import json
import sys

from expertcache.cli.common import (add_cache_args, add_routing_args, check_input_file, check_output_path, check_target, steerable,
                                    pct, print_controller, print_resolved, routing_from_args, target_label)

DESCRIPTION = """\
Replay a routing trace through one expert cache per layer and report the miss rate, the mean expert
lifetime and a per-layer breakdown.

This is OPEN LOOP: the router logits in the trace are fixed, so a cache-aware policy re-ranks experts
without that choice feeding back into later hidden states. Closed-loop numbers (quality and miss rate of
the patched model itself) come from `expertcache eval`.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="open-loop cache simulation of a routing trace",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", default=None,
                   help="routing trace file (default: the demo trace recorded from the shipped model)")
    add_routing_args(p)
    add_cache_args(p)
    p.add_argument("--belady", action="store_true", help="also report Belady's optimal miss rate "
                   "for the same selections (offline bound)")
    p.add_argument("--freq-from", default=None, help="ERAS-bias activation profile: a trace to build it from, "
                   "or a .npy/.json profile from `expertcache analyze --profile-out` (default: the simulated trace)")
    p.add_argument("--target-miss-rate", type=float, default=None, metavar="X",
                   help=f"{steerable()}: an online controller sets the strength to hold the running miss "
                   "rate at X in (0, 1) (docs/BEYOND.md); the fixed --lam / --beta is ignored")
    p.add_argument("--json", action="store_true", help="print one machine-readable JSON row instead of a table")
    p.add_argument("--out", default=None, help="also append the JSON row to this JSONL file")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.set_defaults(func=run, row_outputs=("out",))


def run(args: argparse.Namespace) -> int:
    from expertcache.cache import eviction_rule
    from expertcache.results import append_jsonl
    from expertcache.routing.registry import spec
    from expertcache.sim import activation_frequency, simulate
    from expertcache.trace import RoutingTrace
    from expertcache.trace.demo import demo_trace_path

    routing = routing_from_args(args)
    check_output_path(args.out, "--out")
    check_input_file(args.freq_from, "--freq-from")
    target = args.target_miss_rate
    if target is not None:
        check_target(routing, target)
    print_resolved("simulate", routing, f", cache {args.eviction} C={args.capacity}"
                   + ("" if target is None else f", target miss rate {target}"))
    trace = RoutingTrace.load(args.trace or demo_trace_path())
    freq = None
    if spec(routing.policy).needs_profile:
        if args.freq_from:
            from expertcache.analysis import load_freq

            freq = load_freq(args.freq_from, trace.num_layers, trace.meta.num_experts)
        else:
            freq = activation_frequency(trace.ids_TLK, trace.meta.num_experts)
    if eviction_rule(args.eviction).offline and routing.cache_aware:
        raise ValueError("--eviction belady needs fixed selections; use --eviction lru --belady for the bound")
    hooked = []

    def hook(router):
        from expertcache.routing.budget import wrap

        hooked.append(wrap(router, target, trace.num_layers))
        return hooked[-1]

    result = simulate(trace, routing, args.capacity, eviction=args.eviction, gamma=args.gamma,
                      initial=args.initial, seed=args.seed, belady=args.belady, freq_LE=freq,
                      between_sequences=args.between_sequences, progress=args.progress,
                      router_hook=hook if target is not None else None)
    row = result.to_row()
    label = routing.label()
    if hooked:
        row["controller"] = hooked[0].controller.state()
        label = target_label(routing, target)
    row["config"]["trace"] = str(args.trace or "demo")
    if args.json:
        print(json.dumps(row, sort_keys=True))
    else:
        print_table(row, label, trace.meta, file=sys.stdout)
        if hooked:
            print_controller(row["controller"], sys.stdout)
    if args.out:  # after the result is shown: a full disk loses the file's row, not the result
        sys.stdout.flush()
        append_jsonl(args.out, row)
    return 0


def _fmt(x):
    return "-" if x is None or x != x else f"{x:.1f}"


def print_table(row: dict, label: str, meta, file=sys.stdout) -> None:
    c = row["config"]
    print(f"trace     {c['trace']}  ({meta.model}; {row['tokens']} tokens, {meta.num_layers} MoE layers, "
          f"N={meta.num_experts}, K={meta.top_k})", file=file)
    print(f"routing   {label}   cache: {c['eviction']} C={c['capacity']}/{meta.num_experts} "
          f"({c['initial']} start, {c['between_sequences']} between sequences)   [open loop]", file=file)
    line = f"miss rate {pct(row['miss_rate'])}   mean lifetime {_fmt(row['mean_lifetime'])} tokens"
    if "belady_miss_rate" in row:
        line += f"   Belady bound {pct(row['belady_miss_rate'])}"
    print(line, file=file)
    print(file=file)
    head = f"{'layer':>5} {'miss rate':>10} {'lifetime':>9}"
    if "belady_layer_miss_rates" in row:
        head += f" {'Belady':>8}"
    print(head, file=file)
    for i, (mr, lt) in enumerate(zip(row["layer_miss_rates"], row["layer_mean_lifetimes"])):
        line = f"{i:>5} {pct(mr):>10} {_fmt(lt):>9}"
        if "belady_layer_miss_rates" in row:
            line += f" {pct(row['belady_layer_miss_rates'][i]):>8}"
        print(line, file=file)

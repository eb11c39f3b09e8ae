"""``expertcache eval``: closed-loop evaluation of a routing policy inside a real model on a local task."""

from __future__ import annotations

import argparse
import json
import math
import sys

from expertcache.cli.common import (add_cache_args, add_device_arg, device_from_args, add_predictor_arg, add_routing_args, add_threads_arg, apply_threads,
                                    check_input_file, check_output_path, check_target, nonneg_int, pct, positive_int,
                                    predictor_from_args, print_controller, print_resolved, routing_from_args, steerable,
                                    target_label)

DESCRIPTION = """\
Run a task on the model with the routing policy and one live expert cache per MoE layer installed, and
report the task quality together with the cache miss rate, the mean expert lifetime and Belady's optimal
miss rate for the same recorded selections.

This is CLOSED LOOP: the policy's choices change the hidden states and so every later router decision.
Tasks (local files, see --data-dir): wikitext (perplexity on 1024-token chunks, or the model's context if
shorter), mmlu (5-shot, answer-letter log-likelihood, accuracy), gsm8k (8-shot chain of thought, greedy,
exact match; the policy acts during generation only unless --scope all). Every item is one sequence;
--between-sequences says whether the caches carry over between items or restart empty.
"""


def add_model_task_args(p: argparse.ArgumentParser, *, task_required: bool = True) -> None:
    from expertcache.eval.tasks import TASKS

    g = p.add_argument_group("model and task")
    g.add_argument("--model", default="granular", help="checkpoint folder, or a shipped model: granular | coarse "
                   "(default: granular)")
    g.add_argument("--task", choices=TASKS, required=task_required, default=None, help="evaluation task")
    g.add_argument("--limit", type=positive_int, default=None, help="evaluate only the first N items (chunks, questions)")
    g.add_argument("--data-dir", default=None, help="data folder holding wikitext-2-raw-v1/, mmlu/, gsm8k/ "
                   "(default: $EXPERTCACHE_DATA, else <repo>/../shared/data)")
    g.add_argument("--shots", type=nonneg_int, default=None, help="few-shot exemplars (default: mmlu 5, gsm8k 8)")
    g.add_argument("--max-new-tokens", type=positive_int, default=256, help="gsm8k: generation limit (capped at half the "
                   "context; default 256)")
    g.add_argument("--scope", choices=("all", "generation"), default=None,
                   help="apply the policy to every token or to decoding steps only (default: the task's: "
                   "gsm8k generation, else all)")
    g.add_argument("--freq-from", default=None, help="eras-bias: trace to build the activation profile from")
    add_threads_arg(g)
    add_device_arg(g)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="closed-loop evaluation (quality + miss rate) of a policy inside a model",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_task_args(p)
    add_routing_args(p)
    add_cache_args(p)
    add_predictor_arg(p)
    p.add_argument("--replace-rank", type=positive_int, default=None, help="sensitivity perturbation (policy original): "
                   "replace the expert at this 1-based rank by a random expert outside the top-K")
    g = p.add_argument_group(f"budget-targeted routing ({steerable()})")
    g.add_argument("--target-miss-rate", type=float, default=None, metavar="X",
                   help="instead of a fixed strength, an online controller sets the policy's strength so that the running "
                   "miss rate stays at X in (0, 1) (one strength for all layers; see docs/BEYOND.md)")
    g.add_argument("--target-bytes-per-token", type=float, default=None, metavar="B",
                   help="the same budget in expert bytes loaded per token: X = B / (K * L * bytes of one routed "
                   "expert as loaded)")
    g.add_argument("--calibrate-from", default=None, metavar="TRACE",
                   help="with --target-miss-rate: start the controller at the strength the simulator gives for X on "
                   "this routing trace (default: start at the policy's default strength)")
    p.add_argument("--trace-out", default=None, help="also save the recorded routing trace to this file")
    p.add_argument("--json", action="store_true", help="print one machine-readable JSON row instead of a table")
    p.add_argument("--out", default=None, help="also append the JSON row to this JSONL file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run, row_outputs=("out",))


def freq_profile(args, routing):
    from expertcache.routing.registry import spec

    if not spec(routing.policy).needs_profile:
        return None
    if not args.freq_from:
        raise ValueError(f"{routing.policy} needs --freq-from TRACE (e.g. one recorded with `expertcache trace record`)")
    from expertcache.sim import activation_frequency
    from expertcache.trace import RoutingTrace

    tr = RoutingTrace.load(check_input_file(args.freq_from, "--freq-from"))
    check_trace_fits(tr, args.model, f"--freq-from {args.freq_from}")
    return activation_frequency(tr.ids_TLK, tr.meta.num_experts)


def model_shape(model) -> tuple[int, int, list[int]]:
    """(N experts, K per token, MoE decoder-layer ids) of the model ``model`` (a folder, a shipped or hub name)
    from its config alone, before its weights load."""
    from expertcache.models.adapters import family_for
    from expertcache.models.loader import load_config_checked, resolve_model_path

    cfg = load_config_checked(resolve_model_path(model))
    n = next(getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if
             isinstance(getattr(cfg, k, None), int))
    return n, int(cfg.num_experts_per_tok), list(family_for(cfg).expected_moe_layers(cfg))


def check_trace_fits(trace, model, what: str) -> None:
    """ValueError naming ``what`` unless ``trace`` was recorded from a model of ``model``'s shape."""
    trace.meta.check_fits(*model_shape(model), what)


def budget_hook(args, routing, freq):
    """``router_hook`` for :func:`evaluate` from ``--target-miss-rate`` / ``--calibrate-from`` (None without a
    target); flags are checked here, before the model loads."""
    target = getattr(args, "target_miss_rate", None)
    per_token = getattr(args, "target_bytes_per_token", None)
    if target is None and per_token is None:
        if getattr(args, "calibrate_from", None):
            raise ValueError("--calibrate-from needs --target-miss-rate")
        return None
    if target is not None and per_token is not None:
        raise ValueError("give --target-miss-rate or --target-bytes-per-token, not both")
    if per_token is not None:
        if not (math.isfinite(per_token) and per_token > 0):
            raise ValueError(f"--target-bytes-per-token must be > 0, got {per_token}")
        if args.calibrate_from:
            raise ValueError("--calibrate-from works with --target-miss-rate (convert the bytes first)")
    check_target(routing, 0.5 if target is None else target, "--target-miss-rate / --target-bytes-per-token")
    if args.capacity in (None, "none"):
        raise ValueError("--target-miss-rate needs a cache (--capacity)")
    s0 = None
    if args.calibrate_from:
        from expertcache.eval.budget import calibrate_strength
        from expertcache.trace import RoutingTrace

        tr = RoutingTrace.load(check_input_file(args.calibrate_from, "--calibrate-from"))
        check_trace_fits(tr, args.model, f"--calibrate-from {args.calibrate_from}")
        s0 = calibrate_strength(tr, routing.policy, args.capacity, target, freq_LE=freq, tokens=2048)

    def hook(patch):
        from expertcache.routing.budget import attach, expert_bytes

        x = target
        if per_token is not None:
            x = per_token / (patch.top_k * len(patch.layers) * expert_bytes(patch))
            if not 0.0 < x < 1.0:
                raise ValueError(f"--target-bytes-per-token {per_token:g} is a miss rate of {x:.4g} (K={patch.top_k}, "
                                 f"L={len(patch.layers)}, {expert_bytes(patch)} bytes per expert): must be in (0, 1)")
        return attach(patch, x, **({} if s0 is None else {"s0": s0}))

    return hook


def run(args: argparse.Namespace) -> int:
    from expertcache.eval import evaluate, prepare
    from expertcache.results import append_jsonl

    apply_threads(args, getattr(args, "model", None))
    device = device_from_args(args)
    routing = routing_from_args(args)
    check_output_path(args.out, "--out")
    check_output_path(args.trace_out, "--trace-out")
    from expertcache.cache import eviction_rule

    if eviction_rule(args.eviction).offline:
        raise ValueError(f"a live cache cannot use {args.eviction} (it needs the future); every eval row already reports "
                         "belady_miss_rate for the same selections")
    freq = freq_profile(args, routing)
    predictor = predictor_from_args(args)
    hook = budget_hook(args, routing, freq)
    print_resolved("eval", routing, f", cache {args.eviction} C={args.capacity}"
                   + ("" if not hook else f", target miss rate {args.target_miss_rate}" if args.target_miss_rate
                      is not None else f", target {args.target_bytes_per_token:g} expert bytes per token"))
    model, tok, task = prepare(args.model, args.task, data_dir=args.data_dir, limit=args.limit, shots=args.shots,
                             max_new_tokens=args.max_new_tokens, device=device)
    row = evaluate(model, task, routing, eviction=args.eviction, capacity=args.capacity, gamma=args.gamma,
                   initial=args.initial, seed=args.seed, between_sequences=args.between_sequences, scope=args.scope,
                   freq_LE=freq, replace_rank=args.replace_rank, progress=not args.no_progress,
                   trace_out=args.trace_out, model_name=args.model, prefetch=_prefetcher(predictor, model, tok),
                   router_hook=hook)
    row["device"] = str(device)
    if args.json:
        print(json.dumps(row, sort_keys=True))
    else:
        label = routing.label() if hook is None else target_label(routing, row["controller"]["target"])
        print_table(row, label, file=sys.stdout)
    if args.out:  # after the result is shown: a full disk loses the file's row, not the result
        sys.stdout.flush()
        append_jsonl(args.out, row)
    return 0


def print_table(row: dict, label: str, file=sys.stdout) -> None:
    c = row["config"]
    t = c["task"]
    q = row["quality"]
    qs = f"{q:.3f}" if row["quality_name"] == "ppl" else f"{100 * q:.1f}%"
    print(f"model     {c['model']} ({c['model_type']}, {len(c['moe_layers'])} MoE layers, N={c['num_experts']}, "
          f"K={c['top_k']})", file=file)
    print(f"task      {row['task']}: {t['items']} items, context {t.get('context')}"
          + (f", {t['mean_shots']:.1f} shots on average" if "mean_shots" in t else ""), file=file)
    print(f"routing   {label}   scope {c['scope']}   cache: {c['eviction']} C={c['capacity']}/{c['num_experts']} "
          f"({c['between_sequences']} between sequences)   [closed loop]", file=file)
    line = (f"{row['quality_name']} {qs}   miss rate {pct(row['miss_rate'])}   Belady {pct(row['belady_miss_rate'])}"
            f"   mean lifetime {row['mean_lifetime'] or float('nan'):.1f} tokens")
    if row.get("generation_miss_rate") is not None:
        line += f"   generation-only miss rate {pct(row['generation_miss_rate'])}"
    print(line, file=file)
    if "transfers_per_token_layer" in row:
        print(f"transfers {row['transfers_per_token_layer']:.3f} per token per layer ({row['misses']} demand misses"
              + (f" + {row['prefetched']} --predictor prefetch loads" if row.get("prefetched") else "") + ")", file=file)
    if "net_transfers" in row:
        verdict = "saved" if row["net_transfers"] < 0 else "cost"
        line = (f"predictor prefetch {verdict} {abs(row['net_transfers'])} transfers against the same requests without "
                f"it ({row['misses_without_prefetch']} misses)")
        if row.get("predictor_recall") is not None:
            line += (f"; held-out top-C recall {row['predictor_recall']:.3f} vs the frequency prior's "
                     f"{row['prior_recall']:.3f}")
        print(line, file=file)
    if row.get("controller"):
        print_controller(row["controller"], file)


def _prefetcher(predictor, model, tok):
    """MELINOE --predictor: installs per-item prefetching of the predicted Top-C experts into a patch."""
    if predictor is None:
        return None
    from expertcache.melinoe.prefetch import PatchPrefetcher, item_prompt_texts

    prompt_len = int(predictor.meta.get("config", {}).get("prompt_len", 32))
    return lambda patch, task: PatchPrefetcher(predictor, item_prompt_texts(task, tok, prompt_len), model,
                                               tok).install(patch)

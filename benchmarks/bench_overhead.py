"""Host overhead of a decode step (issue 23's CPU proxy for a GPU decode step): an OLMoE-layout model with
negligible FLOPs (D = 64, F = 32, 64 experts, top-8, 16 layers, fp32, random weights), decoded one token at a
time on 1 thread, so what is timed is Python, torch dispatch and bookkeeping -- the same wall a GPU decode
step hits (one kernel launch per op).

Competitors, interleaved per round (order rotated), each from a fresh KV cache on the same prompt and the same
teacher-forced tokens:

- ``stock``: transformers' own model (``AutoModelForCausalLM.from_pretrained``), all experts in memory;
- ``C=N``: the offloaded runtime with every expert resident (host tier, 0 readers: reads inline), warmed;
- ``cache-prior C=16``: Cache-Prior λ 0.5 at C = 16 (host tier, 0 readers), caches filled by a warm-up decode;
- ``C=N+compile``, ``cache-prior-C=16+compile``: the same with ``OffloadConfig(compile=True)``, decoded through
  ``OffloadedModel.generate`` (teacher-forced; its ``decode_s``): the captured decode step (static KV cache, a
  token's whole step one compiled graph, :mod:`expertcache.models.captured`); compiled during the warm-up, not
  timed.

Per (competitor, round) one JSONL row: ``step_ms_per_layer`` (decode wall time per token ÷ MoE layers: the
whole step, attention included) and ``moe_ms_per_layer`` (time inside the MoE blocks per token and layer,
from forward pre/post hooks on each block: router, routing policy, cache bookkeeping, expert compute,
combine). The issue's target is on the MoE block (≤ 0.3 ms at C = N, ≤ 0.4 ms Cache-Prior C = 16).
Medians over rounds are printed as a markdown table with ratios against ``stock``.

    OMP_NUM_THREADS=1 python benchmarks/bench_overhead.py [--tokens 32] [--rounds 5] [--label NAME]
        [--only stock,C=N,cache-prior-C=16] [--out benchmarks/results/overhead.jsonl]

To compare two source trees in one run, start it twice with different ``PYTHONPATH`` and ``--label``
(or use ``--pythonpath A --pythonpath B``: the rounds of the two trees then interleave in subprocesses).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "overhead.jsonl"
SHAPE = dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, num_experts=64,
             num_experts_per_tok=8, vocab_size=512, max_position_embeddings=512, pad_token_id=1, eos_token_id=2)
COMPETITORS = ("stock", "C=N", "cache-prior-C=16", "C=N+compile", "cache-prior-C=16+compile")


def _model(layers: int, out: Path | None, dtype: str = "float32") -> Path:
    import torch

    from expertcache.offload.make_model import bench_models_dir, make_bench_model

    tag = "" if dtype == "float32" else f"-{dtype}"
    out = out or bench_models_dir() / f"overhead-olmoe-D64-F32-E64-L{layers}{tag}"
    return make_bench_model("olmoe-1b-7b", layers=layers, out=out, dtype=getattr(torch, dtype), overrides=SHAPE)


class _MoETimer:
    """Forward pre/post hooks on every MoE block: seconds spent inside them."""

    def __init__(self, blocks) -> None:
        self.seconds = 0.0
        self._t0 = 0.0
        for b in blocks:
            b.register_forward_pre_hook(self._pre)
            b.register_forward_hook(self._post)

    def _pre(self, mod, args):
        self._t0 = time.perf_counter()

    def _post(self, mod, args, out):
        self.seconds += time.perf_counter() - self._t0


def _decode(forward, make_past, prompt_1S, forced_1N):
    """Seconds of the decode steps (prefill excluded) teacher-forcing ``forced_1N``; ``make_past`` None:
    ``forward(prompt, forced)`` decodes them itself and returns those seconds (``generate``'s own loop)."""
    import torch

    with torch.inference_mode():
        if make_past is None:
            return forward(prompt_1S, forced_1N)
        out = forward(prompt_1S, make_past())
        past = out.past_key_values
        t0 = time.perf_counter()
        for i in range(forced_1N.shape[1]):
            out = forward(forced_1N[:, i:i + 1], past)
            past = out.past_key_values
        return time.perf_counter() - t0


def run(args) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from expertcache.models.adapters import family_for, find_moe_layers
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.bench import machine_info
    from expertcache.routing import RoutingConfig

    torch.set_num_threads(args.threads)
    path = _model(args.layers, Path(args.model) if args.model else None, args.dtype)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, SHAPE["vocab_size"], (1, 8), generator=g)
    forced = torch.randint(3, SHAPE["vocab_size"], (1, args.tokens), generator=g)
    warm_forced = torch.randint(3, SHAPE["vocab_size"], (1, args.tokens), generator=g)
    runners = {}
    only = args.only.split(",") if args.only else COMPETITORS
    if "stock" in only:
        stock = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        blocks = [m.block for m in find_moe_layers(stock, family_for(stock.config))]
        timer = _MoETimer(blocks)
        fwd = lambda ids, past, m=stock: m(input_ids=ids, past_key_values=past, use_cache=True)
        runners["stock"] = (fwd, lambda m=stock: DynamicCache(config=m.config), timer, len(blocks), None)
    for name, cap, routing in (("C=N", None, RoutingConfig()),
                               ("cache-prior-C=16", 16, RoutingConfig("cache-prior", lam=0.5))):
        for compiled in (False, True):
            label = name + ("+compile" if compiled else "")
            if label not in only:
                continue
            rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", capacity=cap, readers=0,
                                                                    context=64 + args.tokens, compile=compiled),
                                                dtype=dtype, routing=routing)
            if cap is None:
                rt.warm()  # every expert resident before the first round
            # the captured step traces the MoE blocks into its graph (a hook on one would keep it opaque): no timer
            timer = None if compiled else _MoETimer([m.block for m in rt.layers])
            if compiled:  # generate's own loop: the captured step (its seconds are the decode steps')
                fwd = lambda ids, forced, r=rt: r.generate(ids, forced.shape[1] + 1, forced_BN=forced)["decode_s"]
                mk = None
            else:
                fwd = lambda ids, past, r=rt: r.forward(ids, past)
                mk = lambda r=rt: DynamicCache(config=r.config)
            runners[label] = (fwd, mk, timer, len(rt.layers), rt)
    for name, (fwd, mk, timer, n_layers, rt) in runners.items():  # warm: caches filled, allocator and dispatch hot
        _decode(fwd, mk, prompt, warm_forced)
    rows = []
    names = list(runners)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fwd, mk, timer, n_layers, rt = runners[name]
            if timer is not None:
                timer.seconds = 0.0
            s0 = rt.stats() if rt is not None else None
            t = _decode(fwd, mk, prompt, forced)
            # the prefill's MoE time is 1 of tokens+1 calls
            moe = timer.seconds * args.tokens / (args.tokens + 1) if timer is not None else None
            row = dict(bench="bench_overhead.py", label=args.label, competitor=name, round=r, tokens=args.tokens,
                       dtype=args.dtype,
                       layers=n_layers, step_ms_per_layer=1e3 * t / args.tokens / n_layers,
                       moe_ms_per_layer=None if moe is None else 1e3 * moe / args.tokens / n_layers, threads=torch.get_num_threads(),
                       device="cpu", src=str(Path(__import__("expertcache").__file__).parent),
                       shape=dict(SHAPE, layers=n_layers), machine=machine_info())
            if rt is not None:
                s1 = rt.stats()
                acc = s1["accesses"] - s0["accesses"]
                row.update(capacity=rt.capacity, routing=rt.routing.to_dict(),
                           hit_rate=(s1["hits"] - s0["hits"]) / acc if acc else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault((r.get("label", ""), r["competitor"]), []).append(r)
    ref = {}
    for (label, name), rs in by.items():
        if name == "stock":
            ref[label] = statistics.median(x["step_ms_per_layer"] for x in rs)
    out = ["| label | competitor | rounds | step ms/layer/token | MoE-block ms/layer/token | step vs stock | hit rate |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for (label, name), rs in by.items():
        step = statistics.median(x["step_ms_per_layer"] for x in rs)
        moes = [x["moe_ms_per_layer"] for x in rs if x.get("moe_ms_per_layer") is not None]
        moe = f"{statistics.median(moes):.3f}" if moes else "in the graph"
        hr = rs[0].get("hit_rate")
        ratio = f"{step / ref[label]:.2f}" if label in ref else "-"
        out.append(f"| {label} | {name} | {len(rs)} | {step:.3f} | {moe} | {ratio} | "
                   f"{'-' if hr is None else f'{hr:.2f}'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per round (teacher-forced)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; competitors interleaved, order rotated")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights and activations (bfloat16: the CPU decode dtype of the shipped models)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(COMPETITORS)}")
    ap.add_argument("--model", default=None, help="checkpoint folder to write/reuse (default: the bench cache)")
    ap.add_argument("--label", default="", help="label stored in every row (e.g. main, h23)")
    ap.add_argument("--pythonpath", action="append", default=None,
                    help="run each round once per source tree (PYTHONPATH), interleaved, in subprocesses; "
                         "the label of each is its path unless --label names them (comma-separated)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    if args.tokens < 1 or args.rounds < 1 or args.threads < 1:
        print("bench_overhead: --tokens, --rounds and --threads must be ≥ 1", file=sys.stderr)
        return 2
    if args.only and set(args.only.split(",")) - set(COMPETITORS):
        print(f"bench_overhead: --only takes {','.join(COMPETITORS)}, got {args.only!r}", file=sys.stderr)
        return 2
    if args.pythonpath:
        labels = args.label.split(",") if args.label else args.pythonpath
        if len(labels) != len(args.pythonpath):
            print("bench_overhead: give one --label per --pythonpath (comma-separated)", file=sys.stderr)
            return 2
        rows = []
        for r in range(args.rounds):
            pairs = list(zip(args.pythonpath, labels))
            for pp, label in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
                cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--rounds", "1", "--layers",
                       str(args.layers), "--threads", str(args.threads), "--label", label, "--out", args.out,
                       "--dtype", args.dtype]
                if args.only:
                    cmd += ["--only", args.only]
                env = dict(os.environ, PYTHONPATH=pp, OMP_NUM_THREADS=str(args.threads),
                           MKL_NUM_THREADS=str(args.threads))
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if res.returncode:
                    print(res.stderr, file=sys.stderr)
                    return res.returncode
                got = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
                for x in got:
                    x["round"] = r
                rows += got
        print(table(rows))
        return 0
    rows = run(args)
    from expertcache.results import append_jsonl

    for row in rows:
        append_jsonl(args.out, row)
    print(table(rows), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

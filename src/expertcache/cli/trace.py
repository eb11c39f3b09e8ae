"""``expertcache trace record|info``: record a routing trace from a model (original routing), describe a trace."""

from __future__ import annotations

import argparse
import math
import os
import sys

from expertcache.cli.common import (add_device_arg, add_threads_arg, apply_threads, capacity_spec, check_input_file,
                                    check_output_path, device_from_args, positive_int)

DESCRIPTION = """\
record: run the model on text with its ORIGINAL routing and save every token's router logits (float16 by
        default), selected experts and weights as a routing trace (the input of `simulate` and open-loop
        `sweep`). Text: the WikiText-2 raw test blob (--task wikitext) or a UTF-8 file (--task text-file
        --file F), tokenised and cut into sequences of the model's context (at most 1024 tokens); the first
        --tokens tokens are kept. The shipped demo trace is
          expertcache trace record --model granular --task wikitext --tokens 4096 \\
              --out src/expertcache/assets/traces/granular-wikitext2.trace.safetensors
info:   shape, metadata, size, and the LRU / Belady miss rates of the recorded selections at --capacity.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record a routing trace from a model, or describe one",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    tsub = p.add_subparsers(dest="trace_command", metavar="{record,info}")
    r = tsub.add_parser("record", help="record a trace under the original routing")
    r.add_argument("--model", default="granular", help="checkpoint folder or shipped model (default granular)")
    r.add_argument("--task", choices=("wikitext", "text-file"), default="wikitext", help="text source")
    r.add_argument("--file", default=None, help="--task text-file: the UTF-8 text file")
    r.add_argument("--data-dir", default=None, help="data folder (default $EXPERTCACHE_DATA, else ../shared/data)")
    r.add_argument("--tokens", type=positive_int, default=4096, help="tokens to record (default 4096)")
    r.add_argument("--logits-dtype", choices=("float16", "float32"), default="float16")
    r.add_argument("--no-weights", action="store_true", help="do not store the combine weights (smaller file)")
    add_threads_arg(r)
    add_device_arg(r)
    r.add_argument("--out", required=True, help="trace file to write (atomically)")
    r.set_defaults(func=run_record)
    i = tsub.add_parser("info", help="describe a trace")
    i.add_argument("file", help="trace file")
    i.add_argument("--capacity", type=capacity_spec, default="0.5", help="cache size for the miss rates shown (default 0.5)")
    i.set_defaults(func=run_info)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_record(args: argparse.Namespace) -> int:
    from expertcache.eval.data import read_text_lines, resolve_eval_data_dir, wikitext_text
    from expertcache.eval.runner import load_model_and_tokenizer
    from expertcache.eval.tasks import WikiTextTask, context_length
    from expertcache.models import patch_model
    from expertcache.routing import RoutingConfig

    check_output_path(args.out, "--out")
    device = device_from_args(args)  # a device this machine lacks: one line, exit 2, before the text is read
    apply_threads(args, getattr(args, "model", None))
    if args.task == "text-file":
        if not args.file:
            raise ValueError("--task text-file needs --file FILE")
        check_input_file(args.file, "--file")
        text, label = "".join(read_text_lines(args.file)), os.path.basename(args.file)
        if not text.strip():
            raise ValueError(f"--file {args.file}: the file is empty (no text to record)")
    else:
        text, label = wikitext_text(resolve_eval_data_dir("wikitext", args.data_dir)), "wikitext-2-raw-v1 test"
    model, tok = load_model_and_tokenizer(args.model)
    model.to(device)  # the task feeds the model's device; the patch records on the host
    ctx = context_length(model)
    try:
        task = WikiTextTask(tok, context=ctx, text=text, limit=math.ceil(args.tokens / ctx))
    except ValueError as exc:  # too short for one chunk: name the text
        raise ValueError(f"{'--file ' + args.file if args.task == 'text-file' else label}: {exc}") from None
    if len(task) * ctx < args.tokens:
        print(f"note: the text has only {len(task) * ctx} tokens in whole chunks of {ctx}", file=sys.stderr)
    with patch_model(model, RoutingConfig(), capacity=None, record=True) as patch:
        out = task.run(model, patch, progress=True)
        trace = patch.trace()
    trace = trace.head(args.tokens)
    trace.meta.model = str(args.model)
    trace.meta.extra.update(text=label, context=ctx, chunk_tokens=ctx, ppl=out["quality"], device=str(device))
    if args.no_weights:
        trace.weights_TLK = None
    path = trace.save(args.out, logits_dtype=args.logits_dtype)
    os.chmod(path, 0o644)  # the atomic write's temporary file is private; traces are shipped as package data
    print(f"wrote {path}: {trace.num_tokens} tokens x {trace.num_layers} MoE layers, N={trace.meta.num_experts}, "
          f"K={trace.meta.top_k}, {len(trace.meta.sequence_starts)} sequences of {ctx} tokens, "
          f"{os.path.getsize(path) / 1e6:.2f} MB (perplexity of the recorded chunks {out['quality']:.2f})")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from expertcache.cache import resolve_capacity
    from expertcache.sim import replay
    from expertcache.trace import RoutingTrace

    tr = RoutingTrace.load(args.file)
    m = tr.meta
    cap = resolve_capacity(args.capacity, m.num_experts)
    lru = replay(tr.ids_TLK, m.num_experts, cap, eviction="lru")
    bel = replay(tr.ids_TLK, m.num_experts, cap, eviction="belady")
    print(f"file        {args.file} ({os.path.getsize(args.file) / 1e6:.2f} MB, format {m.format_version})")
    print(f"model       {m.model}  source {m.source}  scoring {m.scoring}  renormalize {m.renormalize}")
    print(f"shape       {tr.num_tokens} tokens x {m.num_layers} MoE layers (decoder layers {m.layer_ids}), "
          f"N={m.num_experts}, K={m.top_k}; logits {tr.logits_TLE.dtype}, weights "
          f"{'yes' if tr.weights_TLK is not None else 'no'}")
    more = " ..." if len(m.sequence_starts) > 6 else ""
    print(f"sequences   {len(m.sequence_starts)} (starts {m.sequence_starts[:6]}{more})")
    extra = {k: v for k, v in (m.extra or {}).items() if k != "patch"}
    if extra:
        print(f"extra       {extra}")
    print(f"replay      C={cap}/{m.num_experts}, carried across sequences: LRU miss rate {100 * lru.miss_rate:.1f}%, "
          f"Belady {100 * bel.miss_rate:.1f}%, LRU mean lifetime {lru.overall.mean_lifetime:.1f} tokens")
    return 0

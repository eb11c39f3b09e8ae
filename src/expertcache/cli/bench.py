"""``expertcache bench``: decode throughput of every routing policy at equal memory, with the I/O roofline;
``--make-model`` writes random-weight checkpoints at published shapes."""

from __future__ import annotations

import argparse
import json
import sys

from expertcache.cli.common import add_predictor_arg, predictor_from_args
from expertcache.cli.generate import add_offload_args, dtype_from_args, offload_from_args

DESCRIPTION = """\
Measure decode tokens/second of original routing + LRU and of each cache-aware policy with the same fast
memory (same C slots per layer), in one run: for every repeat, every policy starts from empty caches,
prefills the same prompt and decodes --tokens tokens. Reports medians over repeats and the I/O roofline

  predicted s/token = all-resident compute s/token + misses/token × expert bytes / measured tier bandwidth

  expertcache bench --cache-experts 16 --repeats 3
  expertcache bench --make-model olmoe-1b-7b --layers 4            # writes ~3.7 GB under ~/.cache/expertcache
  expertcache bench --model ~/.cache/expertcache/bench-models/olmoe-1b-7b-L4-e1 --cache-experts 32 \\
      --policies original+lru cache-prior

Random-weight checkpoints (--make-model) route almost uniformly: use them for bytes and tokens per second
at real expert sizes, not for quality or for trained-router hit rates.
"""


def register(sub: argparse._SubParsersAction) -> None:
    from expertcache.offload.bench import BENCH_POLICIES
    from expertcache.offload.make_model import BENCH_MODELS

    p = sub.add_parser("bench", help="decode throughput of routing policies at equal memory (I/O roofline)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-model", choices=tuple(BENCH_MODELS), default=None,
                   help="write a random-weight checkpoint at this model's published shapes and exit")
    p.add_argument("--layers", type=int, default=None, help="--make-model: decoder layers (default: published)")
    p.add_argument("--out-dir", default=None, help="--make-model: folder (default ~/.cache/expertcache/bench-models/...)")
    p.add_argument("--policies", nargs="+", choices=BENCH_POLICIES, default=None,
                   help="policies to run (default: all)")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per run (default: 32)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (default: 16)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default: 3)")
    p.add_argument("--prompt-seed", type=int, default=0, help="seed of the prompt")
    p.add_argument("--out", default=None, help="append one JSONL row per (policy, round) to this file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    add_offload_args(p)
    add_predictor_arg(p)
    p.set_defaults(func=run)


def _prompt(path, n: int, batch: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    if (path / "tokenizer.json").is_file():
        from expertcache.train.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
        text = ("The Debian package manager installs, upgrades and removes software; the configuration files "
                "of a package are kept in /etc and its documentation in /usr/share/doc. ")
        ids = tok(text * 4, return_tensors="pt").input_ids[:, :n]
        if batch > 1:
            ids = torch.cat([ids] + [ids.roll(i, dims=1) for i in range(1, batch)])
        return ids
    import json as _json

    vocab = _json.loads((path / "config.json").read_text())["vocab_size"]
    return torch.randint(3, vocab, (batch, n), generator=g)


def run(args: argparse.Namespace) -> int:
    from expertcache.offload.bench import run_bench, table
    from expertcache.offload.runtime import resolve_model_path
    from expertcache.results import append_jsonl

    if args.make_model:
        from expertcache.offload.make_model import make_bench_model

        path = make_bench_model(args.make_model, layers=args.layers, out=args.out_dir, quant=args.quant,
                                group=args.group)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        print(f"{path} ({size / 2**30:.2f} GiB). Random weights: routing is almost uniform -- use it for "
              "throughput at real expert sizes, not for quality.")
        return 0
    predictor = predictor_from_args(args)
    path = resolve_model_path(args.model)
    prompt = _prompt(path, args.prompt_tokens, args.batch, args.prompt_seed)
    forced = None
    if not (path / "tokenizer.json").is_file():  # random-weight model: teacher-force random tokens
        forced = _prompt(path, args.tokens, args.batch, args.prompt_seed + 1)
    offload = offload_from_args(args, context=prompt.shape[1] + args.tokens, batch=args.batch)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    result = run_bench(path, offload, policies=args.policies, prompt_BS=prompt, tokens=args.tokens,
                       repeats=args.repeats, dtype=dtype_from_args(args), forced_BN=forced,
                       on_row=(lambda row: append_jsonl(args.out, row)) if args.out else None, log=log,
                       prefetch=_prefetcher(predictor, path, prompt))
    if args.json:
        print(json.dumps(dict(summary=result["summary"], config=result["config"])))
    else:
        print(table(result))
    return 0


def _prefetcher(predictor, path, prompt_BS):
    """MELINOE --predictor: a callable loading the pooled Top-C prediction of the prompt rows into a runtime."""
    if predictor is None:
        return None
    from expertcache.melinoe.prefetch import prefetch_runtime
    from expertcache.train.tokenizer import load_tokenizer

    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"--predictor needs the prompt as text: {path} has no tokenizer.json")
    tok = load_tokenizer(path)
    texts = [tok.decode(row.tolist()) for row in prompt_BS]
    return lambda rt: prefetch_runtime(rt, predictor, texts, tok)

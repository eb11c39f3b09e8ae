"""``expertcache bench``: decode throughput of every routing policy at equal memory, against the physical floor;
``--make-model`` writes random-weight checkpoints at published shapes."""

from __future__ import annotations

import argparse
import json
import sys

from expertcache.cli.common import (add_predictor_arg, check_output_path, device_from_args, int_in, positive_int,
                                    predictor_from_args, seed_int)

#: the most rows --batch decodes together (the KV cache and the routing of every row are held at once)
MAX_BATCH = 1024
from expertcache.cli.generate import add_offload_args, check_context, dtype_from_args, offload_from_args

DESCRIPTION = """\
Measure decode tokens/second of original routing + LRU and of each cache-aware policy with the same fast
memory (same C slots per layer), in one run and inside the memory plan (no all-resident reference model):
for every repeat, every policy starts from empty caches, prefills the same prompt and decodes --tokens
tokens. Reports medians over repeats against the physical floor

  floor s/token = max(compute s/token, bytes read/token ÷ measured device bandwidth at one expert per read)

where compute = decode time − time the compute thread waited for reads (same run), and the serial
prediction compute + bytes/token ÷ serial bandwidth (what one-read-at-a-time costs) as a second column.

  expertcache bench --cache-experts 16 --repeats 3
  expertcache bench --make-model olmoe-1b-7b --layers 4            # writes ~3.7 GB under ~/.cache/expertcache
  expertcache bench --model ~/.cache/expertcache/bench-models/olmoe-1b-7b-L4-e1 --cache-experts 32 \\
      --policies original+lru cache-prior

Random-weight checkpoints (--make-model) route almost uniformly: use them for bytes and tokens per second
at real expert sizes, not for quality or for trained-router hit rates.
"""


def register(sub: argparse._SubParsersAction) -> None:
    from expertcache.offload.bench import DEFAULT_BENCH, bench_policies
    from expertcache.offload.make_model import BENCH_MODELS

    p = sub.add_parser("bench", help="decode throughput of routing policies at equal memory (vs the physical floor)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make-model", choices=tuple(BENCH_MODELS), default=None,
                   help="write a random-weight checkpoint at this model's published shapes and exit")
    p.add_argument("--layers", type=positive_int, default=None, help="--make-model: decoder layers (default: published)")
    p.add_argument("--out-dir", default=None,
                   help="--make-model: folder (default $EXPERTCACHE_CACHE/bench-models/..., where "
                        "$EXPERTCACHE_CACHE defaults to ~/.cache/expertcache)")
    p.add_argument("--policies", nargs="+", choices=bench_policies(), default=None,
                   help=f"policies to run (default: {' '.join(DEFAULT_BENCH)})")
    p.add_argument("--tokens", type=int_in(2, 1 << 20), default=32,
                   help="decoded tokens per run, ≥ 2: the first comes from the prefill (default: 32)")
    p.add_argument("--prompt-tokens", type=positive_int, default=16, help="prompt length (default: 16)")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH, "rows decoded together"), default=1, help="sequences decoded together (default: 1)")
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds; medians are reported (default: 3)")
    p.add_argument("--prompt-seed", type=seed_int, default=0, help="seed of the prompt")
    p.add_argument("--out", default=None, help="append one JSONL row per (policy, round) to this file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    add_offload_args(p)
    add_predictor_arg(p)
    p.set_defaults(func=run, row_outputs=("out",), replaced_folders=("out_dir",), writer="bench --make-model")


def _prompt(path, n: int, batch: int, seed: int):
    import torch

    from expertcache.models.loader import load_tokenizer_checked, read_config_json

    if (path / "tokenizer.json").is_file() and not (path / "expertcache.json").is_file():
        tok = load_tokenizer_checked(path)
        text = ("The Debian package manager installs, upgrades and removes software; the configuration files "
                "of a package are kept in /etc and its documentation in /usr/share/doc. ")
        ids = tok(text * 4, return_tensors="pt").input_ids[:, :n]
        if batch > 1:
            ids = torch.cat([ids] + [ids.roll(i, dims=1) for i in range(1, batch)])
        return ids
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, read_config_json(path)["vocab_size"], (batch, n), generator=g)


def _print_resolved(path, names) -> None:
    """One stderr line with every benchmarked policy's resolved configuration (top-J included)."""
    from expertcache.models.loader import read_config_json
    from expertcache.offload.bench import DEFAULT_BENCH, policy_set

    k = read_config_json(path).get("num_experts_per_tok")
    if not isinstance(k, int):
        return
    pset = policy_set(k)
    shown = [f"{n}={rc.label()}+{ev}" for n, (rc, ev) in pset.items() if n in (names or DEFAULT_BENCH)]
    print("expertcache bench: policies " + "; ".join(shown), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from expertcache.offload.bench import run_bench, table
    from expertcache.offload.runtime import resolve_model_path
    from expertcache.results import append_jsonl

    check_output_path(args.out, "--out")
    device_from_args(args)  # a bad --device: one line, before anything loads
    if args.make_model:
        from expertcache.offload.make_model import make_bench_model

        check_output_path(args.out_dir, "--out-dir", directory=True)
        path = make_bench_model(args.make_model, layers=args.layers, out=args.out_dir, quant=args.quant,
                                group=args.group)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        print(f"{path} ({size / 2**30:.2f} GiB). Random weights: routing is almost uniform -- use it for "
              "throughput at real expert sizes, not for quality.")
        return 0
    predictor = predictor_from_args(args)
    path = resolve_model_path(args.model)
    check_context(path, args.prompt_tokens, args.tokens, "--tokens")
    prompt = _prompt(path, args.prompt_tokens, args.batch, args.prompt_seed)
    forced = None
    if not (path / "tokenizer.json").is_file() or (path / "expertcache.json").is_file():
        # random-weight model (written by --make-model): teacher-force random tokens
        forced = _prompt(path, args.tokens, args.batch, args.prompt_seed + 1)
    offload = offload_from_args(args, context=prompt.shape[1] + args.tokens, batch=args.batch, path=path)
    _print_resolved(path, args.policies)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    result = run_bench(path, offload, policies=args.policies, prompt_BS=prompt, tokens=args.tokens,
                       repeats=args.repeats, dtype=dtype_from_args(args), forced_BN=forced, device=args.device,
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

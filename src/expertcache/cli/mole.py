"""``expertcache mole``: Mixture of Lookup Experts -- train, export to a lookup table, generate, evaluate.

    expertcache mole train --kind mole --experts 16 --steps 800 --out runs/mole/mole-16   # also --kind dense|moe
    expertcache mole export runs/mole/mole-16/model --out runs/mole/mole-16/table-nf4 --quant nf4
    expertcache mole generate runs/mole/mole-16/table-nf4 "The kernel" --read-mode flash
    expertcache mole eval runs/mole/mole-16/table-nf4 --out runs/mole/rows.jsonl

Training flags are generated from :class:`expertcache.mole.configs.MoleTrainConfig` (one flag per field).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from expertcache.cli.common import add_device_arg, add_threads_arg, apply_threads, config_from_args, device_from_args
from expertcache.jsonsafe import load_path


def register(subparsers) -> None:
    from expertcache.cli.common import add_dataclass_args, csv_of, nonneg_int, positive_int, prompt_text
    from expertcache.mole.configs import KINDS, MoleTrainConfig

    p = subparsers.add_parser("mole", help="Mixture of Lookup Experts: train, export tables, generate, evaluate",
                              description="Mixture of Lookup Experts (seed 002): routed experts on the token "
                              "embedding, re-parameterised into a lookup table read from storage per token.")
    sub = p.add_subparsers(dest="mole_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    t = sub.add_parser("train", help="train a dense, MoE or MoLE model (deterministic, resumable)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_dataclass_args(t, MoleTrainConfig, choices={"kind": KINDS})  # raw field defaults: ``model=""`` is from the kind
    t.add_argument("--tokenizer", default="", help="tokenizer folder (default: the shipped models' tokenizer)")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    t.set_defaults(func=run_train, replaced_folders=(("out", "model"),), writer="train")

    e = sub.add_parser("export", help="re-parameterise a trained MoLE model into a lookup-table folder")
    e.add_argument("model_dir", metavar="MODEL_DIR", help="training-form MoLE model folder (<run>/model)")
    e.add_argument("--out", required=True, metavar="TABLE", help="table folder to write (replaced atomically)")
    e.add_argument("--quant", choices=("none", "int8", "nf4"), default="none",
                   help="table values: none (--dtype), int8 or nf4 (block-wise absmax, 64-value blocks)")
    e.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="values with --quant none")
    add_threads_arg(e)
    e.set_defaults(func=run_export, replaced_folders=("out",), writer="mole export")

    g = sub.add_parser("generate", help="stream a greedy continuation (table form reads the table per token)")
    g.add_argument("model_dir", metavar="TABLE_MODEL", help="exported table folder (or any compared model folder)")
    g.add_argument("prompt", type=prompt_text)
    g.add_argument("--max-new-tokens", type=positive_int, default=64)
    g.add_argument("--read-mode", choices=("mmap", "pread", "flash", "direct"), default="flash",
                   help="how table rows are read: flash/direct bypass the page cache (default: flash)")
    add_threads_arg(g)
    add_device_arg(g)
    g.set_defaults(func=run_generate)

    v = sub.add_parser("eval", help="held-out perplexity, decode latency, bytes loaded per token (one JSON row)")
    v.add_argument("model_dir", metavar="MODEL_DIR", help="a compared model folder or an exported table folder")
    v.add_argument("--data-dir", default="", help="corpus folder (default: as for training)")
    v.add_argument("--tokenizer", default="", help="tokenizer folder (default: the model folder's)")
    v.add_argument("--ppl-tokens", type=nonneg_int, default=131072, help="held-out tokens scored (0 = all)")
    v.add_argument("--read-mode", choices=("mmap", "pread", "flash", "direct"), default="flash",
                   help="table reads during the latency runs (perplexity always uses mmap)")
    v.add_argument("--batches", type=csv_of(positive_int, "batch size", empty_ok=True), default="1,8",
                   help='decode batch sizes timed ("" = none: perplexity only)')
    v.add_argument("--prompt-tokens", type=positive_int, default=64)
    v.add_argument("--new-tokens", type=positive_int, default=32)
    v.add_argument("--moe-tokens", type=positive_int, default=512, help="MoE: positions per sequence replayed through LRU")
    v.add_argument("--moe-capacity", type=nonneg_int, default=0,
                   help="MoE: experts per layer in fast memory (0 = equal fast memory with MoLE: ffn / width = K)")
    add_threads_arg(v)
    v.add_argument("--label", default="", help="row label (default: the folder name)")
    v.add_argument("--out", default="", help="append the row to this JSONL file")
    v.set_defaults(func=run_eval, row_outputs=("out",))


def _check_model_dir(path) -> None:
    """Fail with one line naming the file for a folder without a readable config.json, or a standard
    transformers checkpoint (the dense / MoE compared models) whose config disagrees with its tensors."""
    from pathlib import Path

    from expertcache.models.loader import check_weights_match_config, read_config_json

    cfg = read_config_json(path)
    if cfg.get("lookup_table") or cfg.get("model_type") == "expertcache_mole":
        return
    from transformers import AutoConfig

    check_weights_match_config(Path(path), AutoConfig.from_pretrained(str(path), local_files_only=True))


def _command() -> str:
    return "expertcache " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "expertcache mole"


def run_train(args: argparse.Namespace) -> int:
    from expertcache.cli.common import check_output_path
    from expertcache.mole.configs import MoleTrainConfig
    from expertcache.mole.train import train_mole

    cfg = config_from_args(MoleTrainConfig, args)
    check_output_path(cfg.out or None, "--out", directory=True)
    s = train_mole(cfg, command=_command(), progress=not args.no_progress, tokenizer_dir=args.tokenizer or None)
    print(f"trained {cfg.model}: {s['tokens_seen']} tokens in {s['train_wall_s']:.0f} s; last eval {s['last_eval']}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from expertcache.cli.common import check_output_path
    from expertcache.mole.export import export_table
    from expertcache.mole.table import TableSpec

    check_output_path(args.out, "--out", directory=True)
    apply_threads(args, args.model_dir)
    out = export_table(args.model_dir, args.out, quant=args.quant, dtype=args.dtype, threads=args.threads)
    spec = TableSpec(**load_path(out / "config.json")["lookup_table"])
    print(f"wrote {out}: {spec.quant} table [V={spec.vocab}, L={spec.layers}, N={spec.experts}, D={spec.hidden}], "
          f"{spec.table_bytes / 2**20:.1f} MiB, {spec.record_bytes} bytes read per token")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from expertcache.mole.bench import decode_n_tokens, load_any, prefill

    apply_threads(args, args.model_dir)
    device = device_from_args(args)
    _check_model_dir(args.model_dir)
    model = load_any(args.model_dir, args.read_mode).to(device)  # (also registers MoLE with the Auto classes)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    ids = tok.backend_tokenizer.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    max_len = model.config.max_position_embeddings
    if len(ids) + args.max_new_tokens > max_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens must fit in {max_len} positions")
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    new: list[int] = []

    def on_token(_, next_B):
        before = tok.decode(new)
        new.append(int(next_B[0]))
        sys.stdout.write(tok.decode(new)[len(before):])
        sys.stdout.flush()

    logits, cache = prefill(model, torch.tensor([ids], device=device))
    decode_n_tokens(model, logits, cache, args.max_new_tokens, on_token=on_token)
    sys.stdout.write("\n")
    table = getattr(getattr(model, "model", None), "table", None)
    if table is not None:
        s = table.stats
        print(f"[{args.read_mode}] {s.tokens} positions, {s.reads} table reads, {s.bytes} bytes "
              f"({s.bytes / max(s.tokens, 1):.0f} per position), {1e3 * s.seconds:.1f} ms reading", file=sys.stderr)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from expertcache.cli.common import check_output_path
    from expertcache.mole.report import evaluate

    check_output_path(args.out or None, "--out")
    _check_model_dir(args.model_dir)
    apply_threads(args, args.model_dir)
    row = evaluate(args.model_dir, data_dir=args.data_dir, tokenizer_dir=args.tokenizer or None,
                   ppl_tokens=args.ppl_tokens, read_mode=args.read_mode,
                   batches=[int(b) for b in args.batches.split(",") if b], prompt_tokens=args.prompt_tokens,
                   new_tokens=args.new_tokens, moe_tokens=args.moe_tokens, moe_capacity=args.moe_capacity,
                   threads=args.threads, label=args.label, command=_command())
    print(json.dumps(row))
    if args.out:
        from expertcache.results import append_jsonl

        append_jsonl(args.out, row)
    return 0

"""``expertcache train``: train a shipped model from scratch, ship it into the package, or (re)write its card.

    expertcache train --model granular [--out runs/granular] [--ship]   # train (resumes from <out>/ckpt.safetensors)
    expertcache train --card-only src/expertcache/assets/models/granular  # evaluate + write MODEL_CARD.md

Training flags are generated from :class:`expertcache.train.configs.TrainConfig` (one flag per field).
"""

from __future__ import annotations

import argparse
import shlex
import sys


#: one line per TrainConfig field for ``expertcache train --help`` (the defaults come from TrainConfig)
HELPS = {
    "model": "which architecture to train (granular, coarse: shipped; granular-256: llama.cpp-quantisable, not "
             "shipped; tiny: tests)",
    "out": "run folder: checkpoint, logs and the exported model/ (\"\" = runs/<model>; resumes from its "
           "ckpt.safetensors)",
    "data_dir": "corpus folder of *.jsonl documents (\"\" = $EXPERTCACHE_DATA/corpus-debian-docs or "
                "../shared/data/corpus-debian-docs)",
    "seed": "seed of the initial weights and the batch order",
    "vocab_size": "tokens of the BPE tokenizer trained on the corpus",
    "seq_len": "tokens per training sequence (≥ 2; also the model's context)",
    "batch_size": "sequences per step",
    "steps": "optimizer steps",
    "lr": "peak learning rate (after warm-up; cosine decay to lr × min-lr-ratio)",
    "min_lr_ratio": "final learning rate as a fraction of --lr",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay of the matrices (not embeddings or norms)",
    "grad_clip": "clip the global gradient norm to this",
    "log_every": "steps between loss lines in the log",
    "eval_every": "steps between held-out evaluations",
    "eval_tokens": "held-out tokens scored at each evaluation",
    "ckpt_every": "steps between resumable checkpoints",
    "threads": "torch CPU threads",
    "experts_implementation": "transformers experts kernel: grouped_mm (fastest on CPU here), eager or batched_mm",
    "save_dtype": "dtype of the exported weights",
    "max_docs": "use only the first N documents (0 = all; for tests)",
}


def register(subparsers) -> None:
    from expertcache.cli.common import add_dataclass_args, nonneg_int
    from expertcache.train.configs import MODEL_SPECS, TrainConfig

    p = subparsers.add_parser(
        "train", help="train a small MoE LM from scratch (or write its model card)",
        description="Train one of the shipped MoE models on the Debian-docs corpus (deterministic, resumable), "
        "optionally copy it into the package, or write MODEL_CARD.md for a trained model folder.",
    )
    add_dataclass_args(p, TrainConfig, choices={"model": sorted(MODEL_SPECS)}, defaults=TrainConfig(), helps=HELPS)
    p.add_argument("--ship", action="store_true",
                   help="after training, copy <out>/model into src/expertcache/assets/models/<model>")
    p.add_argument("--card-only", metavar="MODEL_DIR", default=None,
                   help="do not train: evaluate MODEL_DIR and write MODEL_CARD.md and card.json into it")
    p.add_argument("--card-tokens", type=nonneg_int, default=0,
                   help="with --card-only: cap on held-out / WikiText tokens scored (0 = all)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run, replaced_folders=(("out", "model"),), writer="train")


def run(args: argparse.Namespace) -> int:
    from expertcache.train.configs import TrainConfig

    command = "expertcache " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "expertcache train"
    from expertcache.cli.common import check_output_path, config_from_args

    if args.card_only:
        from expertcache.train.card import write_card

        check_output_path(args.card_only, "--card-only", directory=True)
        path = write_card(args.card_only, data_dir=args.data_dir, max_tokens=args.card_tokens, threads=args.threads,
                          command=command)
        print(f"wrote {path}")
        return 0
    from expertcache.train.loop import ship, train

    cfg = config_from_args(TrainConfig, args)
    check_output_path(cfg.out or None, "--out", directory=True)
    from expertcache.assets import SHIPPED_MODELS

    if args.ship and cfg.model not in SHIPPED_MODELS:  # before hours of training, not after
        raise ValueError(f"--ship: {cfg.model} is not a shipped model ({', '.join(SHIPPED_MODELS)}); its folder stays "
                         f"in {cfg.out or 'runs/' + cfg.model}/model")
    summary = train(cfg, command=command, progress=not args.no_progress)
    print(f"trained {cfg.model}: {summary['tokens_seen']} tokens in {summary['train_wall_s']:.0f} s; "
          f"last eval {summary['last_eval']}")
    if args.ship:
        print(f"shipped to {ship(cfg)}")
    return 0

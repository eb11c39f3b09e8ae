"""``expertcache melinoe``: 004's MELINOE -- ``finetune`` (routing locality) and ``predictor`` (prompt -> experts)."""

from __future__ import annotations

import argparse
import shlex
import sys

from expertcache.cli.common import add_dataclass_args, config_from_args
from expertcache.jsonsafe import load_path

DESCRIPTION = """\
MELINOE (seed 004): change the model once so that each sequence leans on fewer experts, then predict those
experts from the prompt and load them before decoding (generate/bench/eval --predictor PATH).

  finetune   L = L_nll + λ_cs L_cs + λ_rm L_rm on the corpus's training split: routers and the experts' gate
             projection in full, peft LoRA on the up/down projections; p_b of L_rm from a frozen copy of the
             base model; --preset fast (default) | 004 (Table 7); writes OUT/model (merged checkpoint),
             OUT/losses.png, OUT/log.jsonl; resumable (run the same command again).
  predictor  all-MiniLM-L6-v2 prompt embedding -> 2-layer MLP -> per-layer expert preferences [L, E], trained
             with KL against the mean router probabilities of the model's continuation; reports top-C
             precision/recall on held-out prompts against the frequency prior; writes OUT (safetensors + JSON).
"""

_FT_HELP = {
    "model": "base checkpoint folder or shipped model (granular | coarse)",
    "preset": "recipe: fast (400 CPU steps, the shipped results) | 004 (004 Table 7, scaled where it cannot apply; "
              "docs/MELINOE.md); any recipe flag given overrides the preset's value",
    "out": "run folder (resumable state, log, plot, model/)",
    "data_dir": "corpus-debian-docs folder (default: $EXPERTCACHE_DATA or <repo>/../shared/data)",
    "steps": "optimizer steps", "batch_size": "sequences per step", "seq_len": "tokens per sequence",
    "lr": "peak learning rate (AdamW, linear schedule)", "warmup_ratio": "warm-up share of the steps",
    "weight_decay": "AdamW weight decay", "grad_clip": "gradient-norm clip",
    "lambda_cs": "λ_cs, weight of the cache-simulation loss", "lambda_rm": "λ_rm, weight of the rank-matching loss",
    "gamma": "γ of the soft cache state", "rho": "ρ, rank-matching margin",
    "capacity": "simulated cache size C (0: E/4)", "lora_r": "LoRA rank on up/down projections",
    "lora_alpha": "LoRA α", "request": "gradient path of the Top-K request vector: st (straight-through) | masked",
    "start": "soft cache start: fill (empty, cache-fill phase) | uniform (‖c‖₁ = C)", "seed": "data seed",
    "train_tokens": "training-split tokens to encode", "eval_tokens": "held-out tokens for the final evaluation",
    "log_every": "hard γ-cache misses logged every N steps", "ckpt_every": "resumable state every N steps",
    "threads": "torch threads", "save_dtype": "dtype of the merged checkpoint",
    "device": "where the model trains: auto (cuda:0 if torch sees one, else cpu), cpu, cuda, cuda:N",
}


def register(sub: argparse._SubParsersAction) -> None:
    from expertcache.melinoe.finetune import PRESET_FIELDS, PRESETS, FinetuneConfig
    from expertcache.melinoe.predictor import PredictorConfig

    p = sub.add_parser("melinoe", help="004 MELINOE: locality fine-tuning and an expert-activation predictor",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    msub = p.add_subparsers(dest="melinoe_command", metavar="SUBCOMMAND")
    ft = msub.add_parser("finetune", help="fine-tune the routers for per-sequence locality (004 Eq. 4-6)")
    add_dataclass_args(ft, FinetuneConfig, helps=_FT_HELP, choices={"preset": tuple(PRESETS)})
    for action in ft._actions:  # recipe flags: None unless given, so that --preset fills the others
        if action.dest in PRESET_FIELDS:
            action.default = None
            action.help = (f"{_FT_HELP.get(action.dest, action.dest)} (default: from --preset: "
                           + ", ".join(f"{name} {rec[action.dest][0]}" for name, rec in PRESETS.items()) + ")")
    ft.add_argument("--no-progress", action="store_true", help="no progress bar")
    ft.set_defaults(func=run_finetune, replaced_folders=(("out", "model"), ("out", "state")), writer="melinoe finetune")
    pr = msub.add_parser("predictor", help="train the prompt -> expert-preference predictor (004 Sec. 3.1.2)")
    add_dataclass_args(pr, PredictorConfig, helps=PredictorConfig.HELP)
    pr.add_argument("--no-progress", action="store_true", help="no progress bar")
    pr.set_defaults(func=run_predictor)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def finetune_config(args):
    """The FinetuneConfig of parsed ``melinoe finetune`` flags: the recipe flags given, the rest from --preset."""
    from expertcache.melinoe.finetune import PRESET_FIELDS, FinetuneConfig, apply_preset

    explicit = {name for name in PRESET_FIELDS if getattr(args, name) is not None}
    return apply_preset(config_from_args(FinetuneConfig, args), explicit)


def run_finetune(args) -> int:
    from expertcache.melinoe.finetune import finetune

    cfg = finetune_config(args)
    cfg.check()  # --out included, before the model loads
    path = finetune(cfg, command="expertcache " + shlex.join(sys.argv[1:]), progress=not args.no_progress)
    summary = load_path(path / "melinoe_summary.json")
    ev = summary["heldout"]
    print(f"wrote {path}: held-out ppl {ev['ppl']:.3f}, γ-cache misses/token/layer "
          f"{ev['gamma_misses_per_token_layer']:.3f} (C={summary['capacity']}, K={summary['top_k']})")
    return 0


def run_predictor(args) -> int:
    from expertcache.melinoe.predictor import PredictorConfig, train_predictor

    cfg = config_from_args(PredictorConfig, args)
    cfg.check()  # --out included, before the model loads
    report = train_predictor(cfg, command="expertcache " + shlex.join(sys.argv[1:]), progress=not args.no_progress)
    for c, r in sorted(report["topc"].items(), key=lambda kv: int(kv[0])):
        gap = r["predictor"]["recall"] - r["prior"]["recall"]
        print(f"C={c}: predictor precision {r['predictor']['precision']:.3f} recall {r['predictor']['recall']:.3f}"
              f"   frequency prior precision {r['prior']['precision']:.3f} recall {r['prior']['recall']:.3f}   "
              + (f"the predictor beats the prior by {gap:.3f}" if gap > 0 else
                 f"the predictor does NOT beat the frequency prior ({gap:+.3f}): prefetching its Top-C saves no more "
                 "than a fixed set of the most used experts would"))
    print(f"wrote {cfg.out}")
    return 0

"""MELINOE fine-tuning (004 Sec. 3.1.1): L = L_nll + λ_cs L_cs + λ_rm L_rm on the corpus's training split.

Trainable (004: "the router weights and gate projection ... LoRA on the MLP up and down projections"):

- every MoE router weight ``[E, D]``, in full;
- the experts' gate projection, in full. transformers 5.x fuses each layer's experts into 3-D parameters
  ``gate_up_proj [E, 2F, D]`` (gate rows first, then up rows) and ``down_proj [E, D, F]``, so the gate
  projection is the first F rows of ``gate_up_proj``: that parameter is trainable with a gradient hook that
  zeroes the up half (weight decay 0, so the up half is not moved by AdamW either);
- LoRA (rank r, α) on the up and down projections through ``peft``'s ``target_parameters`` (peft ≥ 0.17
  wraps a 3-D expert parameter with one rank-r adapter per expert: lora_A [r·E, in], lora_B [out, r·E]).
  peft targets a *whole* parameter, so the LoRA on the fused ``gate_up_proj`` also covers the gate rows
  (which train in full anyway); ``down_proj`` is the down projection.

p_b in L_rm is the *base model's own routing* on the same tokens (004 Eq. 5: the base model's router
distribution): a separate frozen copy of the base checkpoint runs its own forward under ``no_grad`` each step
(:class:`BaseRouting`). peft's ``disable_adapter()`` would not give it: the routers and the gate projection are
trained in full, outside the adapters. (Applying the frozen base *router* to the fine-tuned model's hidden
states, as an earlier version did, is a different distribution from layer 1 on: the hidden states entering
layer ℓ > 0 already carry the fine-tuned routing of the layers below.)

Recipes: :data:`PRESETS` (``--preset``) -- ``fast`` (a few hundred CPU steps, the shipped recipe) and ``004``
(004 Table 7, each value scaled to the shipped models only where it cannot apply as is, with the reason).

Run folder (``out``): ``state/`` (resumable: ``trainable.safetensors`` with the trainable tensors and the AdamW
moments, ``state.json`` with the step, the log and the config -- safetensors + JSON only), ``log.jsonl``,
``losses.png`` (the three losses), ``model/`` (the merged checkpoint: ``save_pretrained`` + the base's tokenizer
files + ``melinoe_summary.json``), written atomically at the end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from expertcache.jsonsafe import load_path
from expertcache.melinoe.losses import cache_sim_loss, hard_misses, rank_match_loss
from expertcache.results import atomic_write_bytes, pyplot, save_figure, save_npy
from expertcache.train.configs import check_positive, check_save_dtype
from expertcache.outputs import check_folder_output, claim_run_folder, publish_folder, temp_folder

__all__ = ["FinetuneConfig", "PRESETS", "apply_preset", "BaseRouting", "step_losses", "finetune", "lr_factor",
           "plot_losses", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass
class FinetuneConfig:
    """Defaults: the ``fast`` preset (:data:`PRESETS`); ``--preset 004`` gives 004 Table 7 -- see docs/MELINOE.md."""

    model: str = "granular"
    out: str = "runs/melinoe-granular"
    data_dir: str | None = None
    preset: str = "fast"
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 5e-3
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lambda_cs: float = 1.0
    lambda_rm: float = 0.1
    gamma: float = 0.9
    rho: float = 0.1
    capacity: int = 0           # 0: E/4 (004: C = E/4)
    lora_r: int = 8
    lora_alpha: float = 4.0
    request: str = "st"
    start: str = "fill"
    seed: int = 0
    train_tokens: int = 2_000_000
    eval_tokens: int = 32_768
    log_every: int = 10
    ckpt_every: int = 50
    threads: int = 1
    save_dtype: str = "bfloat16"
    device: str = "auto"  # where the model trains: auto (cuda:0 if torch sees one, else cpu), cpu, cuda, cuda:N
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        check_positive(self, ("steps", "batch_size", "seq_len", "lora_r", "log_every", "ckpt_every", "threads"),
                       flags=True)
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"--gamma must be in [0, 1], got {self.gamma}")
        if self.lambda_cs < 0 or self.lambda_rm < 0 or self.rho < 0:
            raise ValueError("--lambda-cs, --lambda-rm and --rho must be ≥ 0")
        if self.request not in ("st", "masked"):
            raise ValueError(f"--request must be 'st' or 'masked', got {self.request!r}")
        if self.start not in ("fill", "uniform"):
            raise ValueError(f"--start must be 'fill' or 'uniform', got {self.start!r}")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        check_save_dtype(self.save_dtype, "--save-dtype")
        from expertcache.device import resolve_device

        resolve_device(self.device)  # a device this machine lacks: ValueError naming --device, before any load
        _check_out(self.out)


def _check_out(out: str) -> None:
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    parent = next((q for q in [p, *p.parents] if q.exists()), Path("."))
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {out}: {parent} is not writable")


# Named recipes. Each value: (value, why). ``fast`` is the recipe the shipped results were made with; ``004`` is
# 004 Table 7 (Dolly-15k column, OLMoE), kept as is wherever it applies to the shipped 4-layer, D = 144 models.
_004_TOKENS = 2_000_000
_004_EPOCHS = 3
PRESETS: dict[str, dict[str, tuple[object, str]]] = {
    "fast": {
        "steps": (400, "400 × 8 × 128 = 0.4 M tokens: ≈ 10 min of one shared CPU core"),
        "batch_size": (8, "-"),
        "seq_len": (128, "short windows: 4× cheaper steps than 004's 512 (256 at most here)"),
        "lr": (5e-3, "50× the 004-scaled 1e-4, so that 400 steps move the routers"),
        "warmup_ratio": (0.03, "004 Table 7"),
        "lambda_cs": (1.0, "2× 004's 0.5: at 0.5 and 300 steps the locality gain was 1.33×"),
        "lambda_rm": (0.1, "004 Table 7"),
        "lora_r": (8, "a quarter of 004's 32 (cheaper steps)"),
        "lora_alpha": (4.0, "α/r = 0.5 as in 004 (16/32)"),
        "train_tokens": (2_000_000, "-"),
    },
    "004": {
        "steps": (math.ceil(_004_EPOCHS * _004_TOKENS / (8 * 256)),
                  "3 epochs (004 Table 7, Dolly) over train_tokens at batch_size × seq_len tokens per step "
                  "(recomputed from the train_tokens, batch_size and seq_len given unless --steps is)"),
        "batch_size": (8, "004 Table 7 gives none; 8 sequences"),
        "seq_len": (256, "004: 512 max tokens; the shipped models have max_position_embeddings = 256"),
        "lr": (1e-4, "004: 1e-5 = 1/40 of OLMoE-1B-7B's pre-training peak lr (4e-4); the shipped granular model "
                     "was pre-trained at 4e-3, so the same ratio gives 1e-4 (1e-5 would leave a 7 M model unmoved)"),
        "warmup_ratio": (0.03, "004 Table 7"),
        "lambda_cs": (0.5, "004 Table 7"),
        "lambda_rm": (0.1, "004 Table 7"),
        "lora_r": (32, "004 Table 7 (applies: 32 < D = 144 and < F = 104/416)"),
        "lora_alpha": (16.0, "004 Table 7"),
        "train_tokens": (_004_TOKENS, "the first 2 M tokens of the shuffled training split, of the order of "
                                      "Dolly-15k's size (15 k examples, most far below 512 tokens)"),
    },
}
PRESET_FIELDS = tuple(PRESETS["fast"])


def apply_preset(cfg: FinetuneConfig, explicit: set[str] | frozenset[str] = frozenset()) -> FinetuneConfig:
    """Set ``cfg``'s recipe fields from ``PRESETS[cfg.preset]``, except those named in ``explicit`` (flags the
    user gave); γ, ρ and C are 004's in both presets (the dataclass defaults)."""
    if cfg.preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {cfg.preset!r}")
    for name, (value, _) in PRESETS[cfg.preset].items():
        if name not in explicit:
            setattr(cfg, name, value)
    if cfg.preset == "004" and "steps" not in explicit:  # 3 epochs of whatever token budget and batch are chosen
        cfg.steps = max(1, math.ceil(_004_EPOCHS * cfg.train_tokens / (cfg.batch_size * cfg.seq_len)))
    return cfg


def lr_factor(step: int, steps: int, warmup_ratio: float) -> float:
    """Linear schedule: linear warm-up over ``warmup_ratio·steps`` steps, then linear decay to 0."""
    warm = max(1, math.ceil(warmup_ratio * steps))
    if step < warm:
        return (step + 1) / warm
    return max(0.0, (steps - step) / max(1, steps - warm))


class RouterTap:
    """Forward hooks on the routers: the router probabilities p of every MoE layer's last call."""

    def __init__(self, layers) -> None:
        self.layers = layers
        self.p: list[torch.Tensor | None] = [None] * len(layers)
        self.handles = [m.router.register_forward_hook(self._hook(i)) for i, m in enumerate(layers)]

    def _hook(self, i):
        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            self.p[i] = torch.softmax(logits.float(), dim=-1)
        return hook

    def stacked(self, b: int, t: int) -> torch.Tensor:
        """``[B, L, T, E]`` router probabilities of the last forward (B sequences of T tokens)."""
        return torch.stack([p.view(b, t, -1) for p in self.p], dim=1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class BaseRouting:
    """p_b of L_rm: the frozen base model's own router distributions on the same tokens (004 Eq. 5) -- a
    separate copy of the base checkpoint, no gradient, its own forward per step."""

    def __init__(self, base_model) -> None:
        from expertcache.models.adapters import family_for, find_moe_layers

        self.model = base_model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tap = RouterTap(find_moe_layers(self.model, family_for(self.model)))

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.model(input_ids=x, use_cache=False)
        return self.tap.stacked(x.shape[0], x.shape[1])

    def remove(self) -> None:
        self.tap.remove()


def step_losses(pm, tap: RouterTap, base: BaseRouting, x: torch.Tensor, y: torch.Tensor, cfg: FinetuneConfig,
                k: int, capacity: int) -> dict:
    """One training step's forward: L = L_nll + λ_cs L_cs + λ_rm L_rm on ``x`` -> ``y``; returns the losses
    (tensors) and the router distributions ``pf`` (fine-tuned, with gradient) and ``pb`` (base, frozen)."""
    logits = pm(input_ids=x, use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    pf = tap.stacked(x.shape[0], x.shape[1])
    pb = base(x)
    l_cs = cache_sim_loss(pf, k, capacity, cfg.gamma, start=cfg.start, request=cfg.request)
    l_rm = rank_match_loss(pf, pb, cfg.rho)
    return dict(loss=nll + cfg.lambda_cs * l_cs + cfg.lambda_rm * l_rm, nll=nll, cs=l_cs, rm=l_rm, pf=pf, pb=pb)


def build_trainable(model, cfg: FinetuneConfig):
    """Wrap ``model`` with peft LoRA on the expert projections and mark the full-rank trainables; returns
    (peft model, MoE layers, {name: param} of everything trained)."""
    from peft import LoraConfig, get_peft_model

    from expertcache.models.adapters import family_for, find_moe_layers

    family = family_for(model)
    if family.scoring != "softmax":
        raise ValueError(f"melinoe finetune needs a softmax router; {family.model_type} scores with {family.scoring}")
    layers = find_moe_layers(model, family)
    for m in layers:
        if not hasattr(m.block.experts, "gate_up_proj") or not hasattr(m.block.experts, "down_proj"):
            raise ValueError(f"{family.model_type}: experts without fused gate_up_proj/down_proj are not supported")
    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=[],
                      target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    pm = get_peft_model(model, lcfg)
    for m in layers:
        m.router.weight.requires_grad_(True)
    gate_up = [(n, p) for n, p in pm.named_parameters() if n.endswith("gate_up_proj") and "lora_" not in n]
    if len(gate_up) != len(layers):
        raise RuntimeError(f"found {len(gate_up)} gate_up_proj base parameters for {len(layers)} MoE layers")
    for _, p in gate_up:
        f = p.shape[1] // 2
        p.requires_grad_(True)

        def keep_gate(grad, f=f):  # the up rows are LoRA-only
            grad = grad.clone()
            grad[:, f:] = 0
            return grad
        p.register_hook(keep_gate)
    trainable = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    return pm, layers, trainable


def _save_state(state_dir: Path, trainable: dict, opt: torch.optim.Optimizer, meta: dict) -> None:

    tmp = temp_folder(state_dir)
    try:
        _write_state(tmp, trainable, opt, meta)
        publish_folder(tmp, state_dir, "melinoe finetune")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_state(tmp: Path, trainable: dict, opt: torch.optim.Optimizer, meta: dict) -> None:
    from safetensors.torch import save_file

    tensors = {f"param/{n}": p.detach().contiguous().cpu() for n, p in trainable.items()}
    for n, p in trainable.items():
        st = opt.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors[f"adam/{key}/{n}"] = st[key].contiguous().cpu()
        if "step" in st:
            meta.setdefault("adam_steps", {})[n] = float(st["step"])
    save_file(tensors, str(tmp / "trainable.safetensors"))
    (tmp / "state.json").write_text(json.dumps(meta) + "\n")


def _load_state(state_dir: Path, trainable: dict, opt: torch.optim.Optimizer) -> dict:
    from safetensors.torch import load_file

    meta = load_path(state_dir / "state.json")
    tensors = load_file(str(state_dir / "trainable.safetensors"))
    with torch.no_grad():
        for n, p in trainable.items():
            key = f"param/{n}"
            if key not in tensors:
                raise ValueError(f"{state_dir}: resume state lacks {n} (different model or LoRA settings?)")
            p.copy_(tensors[key])
            if f"adam/exp_avg/{n}" in tensors:
                opt.state[p] = {"step": torch.tensor(meta["adam_steps"][n], device="cpu"),
                                "exp_avg": tensors[f"adam/exp_avg/{n}"].to(p.device, copy=True),
                                "exp_avg_sq": tensors[f"adam/exp_avg_sq/{n}"].to(p.device, copy=True)}
    return meta


def plot_losses(rows: list[dict], path: Path, title: str) -> Path:
    """PNG with L_nll, L_cs and L_rm (one panel each) against the step."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    steps = [r["step"] for r in rows]
    for ax, (key, label) in zip(axes, [("nll", "L_nll"), ("cs", "L_cs (soft misses / token / layer)"),
                                       ("rm", "L_rm")]):
        vals = np.array([r[key] for r in rows], dtype=float)
        ax.plot(steps, vals, lw=0.8, alpha=0.35)
        w = max(1, min(20, len(vals) // 10))
        if w > 1:  # moving average over w steps
            ax.plot(steps[w - 1:], np.convolve(vals, np.ones(w) / w, mode="valid"), lw=1.4, color="C0",
                    label=f"mean of {w} steps")
        if key == "cs":
            hm = [(r["step"], r["hard_misses"]) for r in rows if r.get("hard_misses") is not None]
            if hm:
                ax.plot(*zip(*hm), lw=1, ls="--", label="γ-cache misses (hard)")
                ax.legend(fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=110)


@torch.no_grad()
def heldout_eval(model, stream: np.ndarray, seq_len: int, k: int, capacity: int, gamma: float, max_tokens: int,
                 batch: int = 8) -> dict:
    """Held-out NLL and hard γ-cache misses per token per layer on non-overlapping windows. Leaves ``model`` in
    eval mode (it is called on the merged model after training)."""
    from expertcache.models.adapters import family_for, find_moe_layers

    layers = find_moe_layers(model, family_for(model))
    tap = RouterTap(layers)
    n = min(len(stream), max_tokens) // seq_len
    chunks = torch.from_numpy(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)
    nll, cnt, miss, steps = 0.0, 0, 0.0, 0
    model.eval()
    try:
        for i in range(0, n, batch):
            x = chunks[i:i + batch].to(next(model.parameters()).device)
            logits = model(input_ids=x, use_cache=False).logits.float()
            nll += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                           x[:, 1:].reshape(-1), reduction="sum"))
            cnt += x[:, 1:].numel()
            pf = tap.stacked(x.shape[0], x.shape[1])
            miss += hard_misses(pf, k, capacity, gamma) * x.shape[0]
            steps += x.shape[0]
    finally:
        tap.remove()
    return dict(nll=nll / max(cnt, 1), ppl=math.exp(nll / max(cnt, 1)), tokens=cnt,
                gamma_misses_per_token_layer=miss / max(steps, 1))


def finetune(cfg: FinetuneConfig, *, command: str = "", progress: bool = True, stop_at: int | None = None) -> Path:
    """Run (or resume) a fine-tune; returns the merged checkpoint folder. ``stop_at``: stop after that many
    steps without exporting (tests of resuming)."""
    from transformers import AutoTokenizer

    from expertcache.eval.runner import resolve_model_path
    from expertcache.melinoe.data import split_texts, token_stream
    from expertcache.models import load_model
    from expertcache.train.data import resolve_data_dir, sample_batch

    cfg.check()
    resolve_data_dir(cfg.data_dir)  # a missing corpus fails before the model is loaded
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    src = Path(resolve_model_path(cfg.model))
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"--model {cfg.model}: not a checkpoint folder or a shipped model (granular, coarse)")
    out = Path(cfg.out)
    for name in ("model", "state"):  # replaced later: refused before any work
        check_folder_output(out / name, "--out", "melinoe finetune")
    claim_run_folder(out, "--out", "melinoe finetune", legacy=("model", "state"))  # never a user's folder
    state_dir = out / "state"
    from expertcache.device import resolve_device

    device = resolve_device(cfg.device)
    model = load_model(src).to(device)
    tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    k = int(getattr(model.config, "num_experts_per_tok"))
    pm, layers, trainable = build_trainable(model, cfg)
    e = layers[0].num_experts
    capacity = cfg.capacity or max(k, e // 4)
    if not 1 <= capacity <= e:
        raise ValueError(f"--capacity must be in [1, E={e}], got {capacity}")
    data_cache = out / "data"
    data_cache.mkdir(exist_ok=True)
    streams = {}
    for split, budget in (("train", cfg.train_tokens), ("heldout", cfg.eval_tokens)):
        f = data_cache / f"{split}-{budget}.npy"
        if f.exists():
            streams[split] = np.load(f, allow_pickle=False)
        else:
            streams[split] = token_stream(tok, split_texts(cfg.data_dir, split=split, seed=cfg.seed), budget)
            save_npy(f, streams[split])
    train_N = streams["train"]
    opt = torch.optim.AdamW(list(trainable.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rows: list[dict] = []
    start = 0
    tap = RouterTap(layers)  # the tuned model's router probabilities (p of L_cs and L_rm)
    if (state_dir / "state.json").exists():
        meta = _load_state(state_dir, trainable, opt)
        if meta["config"]["model"] != cfg.model or meta["config"]["lora_r"] != cfg.lora_r:
            raise ValueError(f"{out}: holds a run of {meta['config']['model']} (lora r {meta['config']['lora_r']}); "
                             "use another --out")
        start, rows = meta["step"], meta["rows"]
        print(f"resuming {out} at step {start}", file=sys.stderr)
    base = BaseRouting(load_model(src).to(device))  # p_b: the base model's own routing (a second, frozen copy)
    pm.train()
    t0 = time.time()
    from tqdm import tqdm

    bar = tqdm(total=cfg.steps, initial=start, desc=f"melinoe finetune {cfg.model}", unit="step", disable=not progress)
    stop = cfg.steps if stop_at is None else min(cfg.steps, stop_at)

    def save(step: int) -> None:
        _save_state(state_dir, trainable, opt, dict(step=step, rows=rows, config=asdict(cfg), capacity=capacity))

    for step in range(start, stop):
        for g in opt.param_groups:
            g["lr"] = cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_ratio)
        xy = torch.from_numpy(sample_batch(train_N, cfg.batch_size, cfg.seq_len, cfg.seed, step)).to(device)
        x, y = xy[:, :-1], xy[:, 1:]
        res = step_losses(pm, tap, base, x, y, cfg, k, capacity)
        loss, nll, l_cs, l_rm, pf = res["loss"], res["nll"], res["cs"], res["rm"], res["pf"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(trainable.values()), cfg.grad_clip)
        opt.step()
        row = dict(step=step + 1, loss=loss.item(), nll=nll.item(), cs=l_cs.item(), rm=l_rm.item(),
                   lr=opt.param_groups[0]["lr"], elapsed_s=round(time.time() - t0, 2))
        if (step + 1) % cfg.log_every == 0 or step == 0:
            row["hard_misses"] = hard_misses(pf, k, capacity, cfg.gamma)
        rows.append(row)
        bar.update(1)
        bar.set_postfix(nll=f"{row['nll']:.3f}", cs=f"{row['cs']:.3f}", rm=f"{row['rm']:.2f}")
        if (step + 1) % cfg.ckpt_every == 0 and step + 1 < stop:
            save(step + 1)
    bar.close()
    tap.remove()
    base.remove()
    save(stop)
    atomic_write_bytes(out / "log.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    if rows:
        plot_losses(rows, out / "losses.png", f"melinoe finetune {cfg.model}: λ_cs={cfg.lambda_cs} "
                    f"λ_rm={cfg.lambda_rm} γ={cfg.gamma} ρ={cfg.rho} C={capacity}")
    if stop < cfg.steps:
        return out / "model"
    return export(pm, src, out, cfg, rows, capacity, k, streams["heldout"], command)


def export(pm, src: Path, out: Path, cfg: FinetuneConfig, rows: list[dict], capacity: int, k: int,
           heldout: np.ndarray, command: str) -> Path:
    """Merge the LoRA weights, write ``out/model`` (save_pretrained + tokenizer files + summary) atomically."""
    merged = pm.merge_and_unload()
    ev = heldout_eval(merged, heldout, cfg.seq_len, k, capacity, cfg.gamma, cfg.eval_tokens)
    final, tmp = out / "model", temp_folder(out / "model")
    try:
        return _export(merged, src, out, cfg, rows, capacity, k, ev, command, final, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _export(merged, src, out, cfg, rows, capacity, k, ev, command, final, tmp) -> Path:
    export_model = merged.to(getattr(torch, cfg.save_dtype))
    export_model.config.use_cache = True
    export_model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    shutil.copy(out / "losses.png", tmp / "losses.png")
    summary = dict(command=command, base=str(src), config=asdict(cfg), capacity=capacity, top_k=k,
                   steps_done=len(rows), final=rows[-1] if rows else None, heldout=ev,
                   wall_s=rows[-1]["elapsed_s"] if rows else 0.0)
    (tmp / "melinoe_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return publish_folder(tmp, final, "melinoe finetune")

"""The training loop: seeded, deterministic, resumable; writes a Hugging Face checkpoint, a JSONL log and a PNG.

Run directory layout (``cfg.out``)::

    tokenizer/            byte-level BPE trained on the training split
    data/train.npy        uint16 token stream of the training split (docs joined with eos)
    data/heldout.npy      same for the held-out split
    ckpt.safetensors      latest resumable checkpoint, replaced atomically: model and optimizer tensors and the
                          torch / numpy RNG states as tensors, everything else (step, log, config, optimizer
                          hyper-parameters, Python RNG) as JSON in the header -- nothing in it can run code
                          (the pickled ``ckpt.pt`` of earlier versions is refused, never unpickled)
    log.jsonl             one row per ``log_every`` steps ({"step","loss","aux_loss","lr",...}) and per eval
    model/                the exported HF checkpoint (config.json, model.safetensors, tokenizer, loss_curve.png,
                          train_log.jsonl, train_summary.json), refreshed at every eval and at the end
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from expertcache import __version__
from expertcache.jsonsafe import loads
from expertcache.outputs import MARK, check_folder_output, claim_run_folder, publish_folder, temp_file, temp_folder
from expertcache.results import named, pyplot, save_figure, save_npy
from expertcache.train.configs import MODEL_SPECS, TrainConfig, build_hf_config, build_model, count_params
from expertcache.train.data import encode_stream, load_documents, resolve_data_dir, sample_batch, split_documents
from expertcache.train.tokenizer import load_tokenizer, train_tokenizer


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate for 0-based ``step``: linear warmup to ``lr``, then cosine to ``lr * min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _load_tokens(path: Path) -> np.ndarray:
    """A token stream written by :func:`prepare_data` (plain .npy; object arrays are refused, never unpickled)."""
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{path}: not a token array ({exc}); delete {path.parent} to rebuild it") from None
    if arr.ndim != 1 or arr.dtype.kind not in "ui":
        raise ValueError(f"{path}: expected a 1-D integer token array, got {arr.dtype} {arr.shape}; "
                         f"delete {path.parent} to rebuild it")
    return arr


def prepare_data(cfg: TrainConfig, run_dir: Path):
    """(tokenizer, train stream ``[N]``, held-out stream ``[M]``); reuses what ``run_dir`` already holds."""
    tok_dir, data_dir = run_dir / "tokenizer", run_dir / "data"
    if (tok_dir / "tokenizer.json").exists() and (data_dir / "heldout.npy").exists():
        return load_tokenizer(tok_dir), _load_tokens(data_dir / "train.npy"), _load_tokens(data_dir / "heldout.npy")
    docs = load_documents(resolve_data_dir(cfg.data_dir), cfg.max_docs)
    train_docs, heldout_docs = split_documents(docs)
    if not train_docs or not heldout_docs:
        raise ValueError(f"split gave {len(train_docs)} training and {len(heldout_docs)} held-out documents")
    tok = train_tokenizer([d["text"] for d in train_docs], cfg.vocab_size, tok_dir, cfg.seq_len)
    train_N = encode_stream(tok, [d["text"] for d in train_docs], tok.eos_token_id)
    heldout_N = encode_stream(tok, [d["text"] for d in heldout_docs], tok.eos_token_id)
    for name, arr, n_docs in (("training", train_N, len(train_docs)), ("held-out", heldout_N, len(heldout_docs))):
        if len(arr) < cfg.seq_len:  # no whole chunk: nothing to train on / perplexity 1.0 from 0 scored tokens
            raise ValueError(f"the {name} split of {resolve_data_dir(cfg.data_dir)} ({n_docs} documents) encodes to "
                             f"{len(arr)} tokens, fewer than one {cfg.seq_len}-token sequence (--seq-len)")
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, arr in (("train", train_N), ("heldout", heldout_N)):
        save_npy(data_dir / f"{name}.npy", arr)
    meta = {"docs_train": len(train_docs), "docs_heldout": len(heldout_docs), "tokens_train": int(len(train_N)),
            "tokens_heldout": int(len(heldout_N))}
    (data_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return tok, train_N, heldout_N


@torch.no_grad()
def evaluate_nll(model, stream_N: np.ndarray, seq_len: int, max_tokens: int = 0, batch_size: int = 16) -> tuple[float, int]:
    """(mean next-token NLL in nats, tokens scored) over non-overlapping ``seq_len``-token chunks of ``stream_N``
    (each chunk scored from scratch; the first token of a chunk is context only). ``max_tokens > 0`` caps the text."""
    n = len(stream_N) if not max_tokens else min(len(stream_N), max_tokens)
    chunks_CT = torch.from_numpy(stream_N[: (n // seq_len) * seq_len].astype(np.int64)).view(-1, seq_len)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(chunks_CT), batch_size):
        x_BT = chunks_CT[i : i + batch_size]
        logits_BTV = model(input_ids=x_BT, output_router_logits=False).logits.float()
        nll = torch.nn.functional.cross_entropy(logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]),
                                                x_BT[:, 1:].reshape(-1), reduction="sum")
        total += nll.item()
        count += x_BT[:, 1:].numel()
    model.train(was_training)
    if count == 0:  # a mean over nothing would read as NLL 0, perplexity 1.0
        raise ValueError(f"no whole {seq_len}-token sequence to score ({n} tokens)")
    return total / count, count


CKPT_NAME = "ckpt.safetensors"
LEGACY_CKPT_NAME = "ckpt.pt"  # pickled checkpoints of earlier versions: never loaded (unpickling can run code)
_CKPT_META_KEY = "expertcache_train_state"
CKPT_FORMAT = 1


def _state_tensors(state: dict, prefix: str, seen: set) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors for safetensors; a tensor that shares storage with one already taken (tied
    weights) is copied, since safetensors refuses shared storage (``seen`` holds storage pointers)."""
    out = {}
    for k, t in state.items():
        t = t.detach().cpu().contiguous()
        key = t.untyped_storage().data_ptr() if t.numel() else None
        if key in seen:
            t = t.clone()
        elif key is not None:
            seen.add(key)
        out[prefix + k] = t
    return out


def save_train_state(path: Path, *, model_state: dict, optim_state: dict, rng: dict, info: dict) -> None:
    """Write the resumable training state to ``path`` (safetensors; replaced atomically).

    Tensors: ``model.<name>``, ``optim.<param index>.<name>`` (tensor entries of the optimizer state),
    ``rng.torch``, ``rng.numpy``. JSON header entry: ``info`` plus the optimizer's ``param_groups`` and
    non-tensor state entries and the scalar parts of the RNG states."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = _state_tensors(model_state, "model.", seen)
    optim_scalars: dict[str, dict] = {}
    for idx, entry in optim_state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors.update(_state_tensors({f"{idx}.{name}": value}, "optim.", seen))
            else:
                optim_scalars.setdefault(str(idx), {})[name] = value
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    tensors["rng.torch"] = rng["torch"].clone()
    tensors["rng.numpy"] = torch.from_numpy(np.asarray(np_keys, dtype=np.int64))
    py_version, py_internal, py_gauss = rng["python"]
    meta = dict(info, format=CKPT_FORMAT, optim_param_groups=optim_state["param_groups"],
                optim_scalars=optim_scalars, optim_state_ids=[str(i) for i in optim_state["state"]],
                rng_numpy=[np_name, int(np_pos), int(np_has_gauss), float(np_gauss)],
                rng_python=[py_version, list(py_internal), py_gauss])
    tmp = temp_file(path)
    try:
        save_file(tensors, str(tmp), metadata={_CKPT_META_KEY: json.dumps(meta)})
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise named(exc, path) from None
        raise


def load_train_state(path: Path) -> tuple[dict, dict, dict, dict]:
    """(model state, optimizer state, RNG states, info) from a file written by :func:`save_train_state`.
    Only safetensors and JSON are read. Raises ValueError naming ``path`` for anything malformed."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(_CKPT_META_KEY)
            if raw is None:
                raise ValueError("not an expertcache training checkpoint (no training state in its header)")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = loads(raw, what="training state header")
        if meta.get("format") != CKPT_FORMAT:
            raise ValueError(f"checkpoint format {meta.get('format')!r} is not {CKPT_FORMAT}")
        model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        state: dict[int, dict] = {}
        for sid in meta["optim_state_ids"]:
            entry = dict(meta["optim_scalars"].get(sid, {}))
            prefix = f"optim.{sid}."
            entry.update({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
            state[int(sid)] = entry
        groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
                  for g in meta["optim_param_groups"]]
        np_name, np_pos, np_has_gauss, np_gauss = meta["rng_numpy"]
        py_version, py_internal, py_gauss = meta["rng_python"]
        rng = {"torch": tensors["rng.torch"],
               "numpy": (np_name, tensors["rng.numpy"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss),
               "python": (py_version, tuple(py_internal), py_gauss)}
        info = {k: meta[k] for k in ("step", "log", "config", "elapsed_s")}
    except ValueError as exc:
        raise ValueError(f"{path}: unreadable training checkpoint ({exc}); delete it to start over") from None
    except Exception as exc:  # KeyError/TypeError from a bad header, safetensors' own errors for a corrupt file
        raise ValueError(f"{path}: unreadable training checkpoint ({type(exc).__name__}: {exc}); "
                         f"delete it to start over") from None
    return model_state, {"state": state, "param_groups": groups}, rng, info


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def plot_losses(rows: list[dict], path: Path, title: str) -> None:
    """Loss-curve PNG (train CE per logged window; held-out CE at each eval) from log rows."""
    plt = pyplot()
    train = [(r["tokens"] / 1e6, r["loss"]) for r in rows if "loss" in r]
    held = [(r["tokens"] / 1e6, r["heldout_loss"]) for r in rows if "heldout_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
    if train:
        ax.plot(*zip(*train), label="train CE (window mean)", lw=1)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out CE", ms=3)
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def export_model(model, tok, cfg: TrainConfig, run_dir: Path, rows: list[dict], summary: dict) -> Path:
    """Write ``run_dir/model`` (HF checkpoint in ``cfg.save_dtype`` + tokenizer + log + PNG + summary); the folder is
    built next to the old one and swapped in, so a reader never sees a half-written export."""
    final, tmp = run_dir / "model", temp_folder(run_dir / "model")
    try:
        return _export_model(model, tok, cfg, run_dir, rows, summary, final, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _export_model(model, tok, cfg, run_dir, rows, summary, final, tmp) -> Path:
    import copy

    export = copy.deepcopy(model).to(getattr(torch, cfg.save_dtype))
    export.config.use_cache = True
    export.config.output_router_logits = False  # inference default; training passes output_router_logits=True
    export.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.copy(run_dir / "tokenizer" / "tokenizer_config.json", tmp / "tokenizer_config.json")
    with open(tmp / "train_log.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    plot_losses(rows, tmp / "loss_curve.png", f"expertcache {cfg.model}: {summary['command']}")
    (tmp / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return publish_folder(tmp, final, "train")


def build_shipped_model(cfg: TrainConfig, tok) -> tuple[torch.nn.Module, dict]:
    """The default model builder of :func:`train`: (fresh ``MODEL_SPECS[cfg.model]`` model, spec as a dict)."""
    spec = MODEL_SPECS[cfg.model]
    hf_cfg = build_hf_config(spec, len(tok), cfg.seq_len, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id,
                             cfg.experts_implementation)
    return build_model(hf_cfg), dict(spec.__dict__)


def train(cfg: TrainConfig, command: str = "", progress: bool = True, stop_at: int | None = None,
          builder=None) -> dict:
    """Train ``cfg.model`` from scratch, or resume from ``<out>/ckpt.safetensors`` if it exists with the same config.

    ``builder(cfg, tokenizer) -> (model, spec_dict)`` makes the fresh model (called right after seeding);
    the default is :func:`build_shipped_model`. A model whose output has no ``aux_loss`` is trained on CE alone.

    Returns the training summary (also written to ``<out>/model/train_summary.json``). The batch of every step is a
    pure function of ``(seed, step)`` and the model init of ``seed``, so a resumed run reproduces an uninterrupted run
    exactly (same losses, same weights) on the same machine and thread count. ``stop_at`` ends the run early after
    that step (checkpoint written, as if interrupted there).
    """
    from tqdm import tqdm

    torch.set_num_threads(cfg.threads)
    run_dir = Path(cfg.out or f"runs/{cfg.model}")
    check_folder_output(run_dir / "model", "--out", "train")  # replaced at the end: refused before any work
    if (run_dir / LEGACY_CKPT_NAME).exists():  # named before the folder rule: its own, clearer reason
        raise ValueError(f"{run_dir / LEGACY_CKPT_NAME} is a pickled checkpoint, which expertcache does not load "
                         f"(unpickling a file can run code); delete it to start over, or use another --out")
    claim_run_folder(run_dir, "--out", "train", legacy=(CKPT_NAME, "model"))  # a user's folder: never written into
    tok, train_N, heldout_N = prepare_data(cfg, run_dir)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    model, spec_info = (builder or build_shipped_model)(cfg, tok)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    step, rows, elapsed = 0, [], 0.0
    ckpt_path = run_dir / CKPT_NAME
    if ckpt_path.exists():
        model_state, optim_state, rng, ckpt = load_train_state(ckpt_path)
        if ckpt["config"] != cfg.to_dict():
            diff = {k: (ckpt["config"].get(k), v) for k, v in cfg.to_dict().items() if ckpt["config"].get(k) != v}
            raise ValueError(f"{ckpt_path} was written with a different config (checkpoint, now): {diff}; "
                             f"use another --out or delete it")
        try:
            model.load_state_dict(model_state)
            opt.load_state_dict(optim_state)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise ValueError(f"{ckpt_path} does not fit this model ({str(exc).splitlines()[0]}); "
                             f"use another --out or delete it") from None
        step, rows, elapsed = ckpt["step"], ckpt["log"], ckpt["elapsed_s"]
        _set_rng_state(rng)
    with open(run_dir / "log.jsonl", "w") as fh:  # the log always matches the checkpoint we continue from
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    total, experts = count_params(model)
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def summary() -> dict:
        return {"model": cfg.model, "arch": type(model).__name__, "command": command, "config": cfg.to_dict(),
                "spec": spec_info, "params_total": total, "params_experts": experts,
                "experts_share": experts / total, "steps_done": step, "tokens_seen": step * tokens_per_step,
                "train_tokens_available": int(len(train_N)), "heldout_tokens": int(len(heldout_N)),
                "train_wall_s": round(elapsed, 1), "threads": cfg.threads, "torch": torch.__version__,
                "expertcache": __version__, "last_eval": next((r for r in reversed(rows) if "heldout_loss" in r), None)}

    def save_ckpt() -> None:
        save_train_state(ckpt_path, model_state=model.state_dict(), optim_state=opt.state_dict(), rng=_rng_state(),
                         info={"step": step, "log": rows, "config": cfg.to_dict(), "elapsed_s": elapsed})

    log_fh = open(run_dir / "log.jsonl", "a")
    window: list[tuple[float, float]] = []
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {cfg.model}", disable=not progress, mininterval=20,
               unit="step")
    t_last = time.time()
    while step < (cfg.steps if stop_at is None else min(stop_at, cfg.steps)):
        lr = lr_at(cfg, step)
        for group in opt.param_groups:
            group["lr"] = lr
        batch_BT1 = torch.from_numpy(sample_batch(train_N, cfg.batch_size, cfg.seq_len, cfg.seed, step))
        # CE on all T targets of the T+1 window (HF's labels= would shift and drop one), plus the model's own
        # load-balancing loss (``out.aux_loss``, from output_router_logits=True) times router_aux_loss_coef.
        out = model(input_ids=batch_BT1[:, :-1], output_router_logits=True, use_cache=False)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                               batch_BT1[:, 1:].reshape(-1))
        aux = getattr(out, "aux_loss", None)
        if aux is None:
            aux = torch.zeros(())
        loss = ce + getattr(model.config, "router_aux_loss_coef", 0.0) * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        window.append((ce.item(), aux.item()))
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            row = {"step": step, "tokens": step * tokens_per_step, "loss": float(np.mean([w[0] for w in window])),
                   "aux_loss": float(np.mean([w[1] for w in window])), "lr": lr, "elapsed_s": round(elapsed, 2)}
            window.clear()
            rows.append(row)
            log_fh.write(json.dumps(row) + "\n")
            log_fh.flush()
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{step * tokens_per_step / max(elapsed, 1e-9):.0f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            nll, n = evaluate_nll(model, heldout_N, cfg.seq_len, cfg.eval_tokens)
            row = {"step": step, "tokens": step * tokens_per_step, "heldout_loss": nll, "heldout_ppl": math.exp(nll),
                   "heldout_tokens_scored": n, "elapsed_s": round(elapsed, 2)}
            rows.append(row)
            log_fh.write(json.dumps(row) + "\n")
            log_fh.flush()
            t_last = time.time()  # evaluation time is not training time
        if step % cfg.ckpt_every == 0 or step == cfg.steps or step == stop_at:
            save_ckpt()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                export_model(model, tok, cfg, run_dir, rows, summary())
            t_last = time.time()
    bar.close()
    log_fh.close()
    result = summary()
    export_model(model, tok, cfg, run_dir, rows, result)
    return result


def ship(cfg: TrainConfig) -> Path:
    """Copy ``<out>/model`` into ``expertcache/assets/models/<model>`` (replacing it; an existing MODEL_CARD.md and
    card.json are kept). Returns the destination."""
    from expertcache.assets import MODELS_DIR

    src = Path(cfg.out or f"runs/{cfg.model}") / "model"
    if not (src / "model.safetensors").exists():
        raise FileNotFoundError(f"nothing to ship: {src} has no model.safetensors (train first)")
    dest = MODELS_DIR / cfg.model
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != MARK:  # the shipped folder is the package's, not this run's output
            shutil.copy(f, dest / f.name)
    return dest

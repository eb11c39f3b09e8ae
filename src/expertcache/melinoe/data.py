"""Token streams and prompts from the shared corpus's training / held-out split (:mod:`expertcache.train.data`)."""

from __future__ import annotations

import numpy as np

from expertcache.train.data import encode_stream, load_documents, resolve_data_dir, split_documents

__all__ = ["split_texts", "token_stream", "prompt_windows"]


def split_texts(data_dir=None, *, split: str = "train", seed: int = 0) -> list[str]:
    """The documents of one split (``train`` | ``heldout``) of corpus-debian-docs, in a seeded shuffled order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    docs = load_documents(resolve_data_dir(data_dir))
    train, heldout = split_documents(docs)
    chosen = train if split == "train" else heldout
    if not chosen:
        raise ValueError(f"the corpus has no {split} documents")
    order = np.random.default_rng(seed).permutation(len(chosen))
    return [chosen[i]["text"] for i in order]


def token_stream(tok, texts: list[str], max_tokens: int) -> np.ndarray:
    """uint16 stream of ``texts`` (each followed by eos) cut at ``max_tokens`` (encoded in chunks, stops early)."""
    parts, n = [], 0
    for i in range(0, len(texts), 64):
        arr = encode_stream(tok, texts[i:i + 64], tok.eos_token_id)
        parts.append(arr)
        n += len(arr)
        if max_tokens and n >= max_tokens:
            break
    out = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    return out[:max_tokens] if max_tokens else out


def prompt_windows(tok, texts: list[str], n: int, prompt_len: int, cont_len: int
                   ) -> list[tuple[str, list[int], list[int]]]:
    """Up to ``n`` (prompt text, prompt ids, continuation ids) from the starts of documents long enough for
    ``prompt_len + cont_len`` tokens: one per document, so prompts differ in topic."""
    out = []
    for enc, text in zip(tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False), texts):
        ids = enc.ids
        if len(ids) < prompt_len + cont_len:
            continue
        p_ids = ids[:prompt_len]
        out.append((tok.decode(p_ids), p_ids, ids[prompt_len:prompt_len + cont_len]))
        if len(out) >= n:
            break
    return out

"""eval.data.text_token_chunks, shared by bench_quant's and bench_llama_quality's KL (the same token ids for every
system): the held-out split and WikiText-2, against the tokenizer run here by hand."""

from __future__ import annotations

import pytest
import torch

from expertcache.eval.data import text_token_chunks


def test_wikitext_chunks_are_the_tokenizers_first_ids(tmp_path):
    from expertcache.eval.data import resolve_eval_data_dir, wikitext_text
    from expertcache.models.loader import resolve_model_path
    from tokenizers import Tokenizer

    try:
        body = wikitext_text(resolve_eval_data_dir("wikitext"))
    except Exception as exc:  # a fresh clone without ../shared
        pytest.skip(f"WikiText-2 not found: {exc}")
    path = resolve_model_path("granular")
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(body, add_special_tokens=False).ids
    got = text_token_chunks(path, "wikitext", 3, seq=64)
    assert got.dtype == torch.int64 and got.shape == (3, 64)
    assert got.flatten().tolist() == ids[:192]
    with pytest.raises(ValueError, match="wikitext text gives"):
        text_token_chunks(path, "wikitext", len(ids) // 64 + 1, seq=64)

"""Byte-level BPE tokenizer trained with ``tokenizers`` and saved for ``AutoTokenizer.from_pretrained(dir)``."""

from __future__ import annotations

import json
from pathlib import Path

from expertcache.jsonsafe import load_path

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str | Path, model_max_length: int):
    """Train a byte-level BPE on ``texts`` (the training split only), save ``tokenizer.json`` and
    ``tokenizer_config.json`` (class ``PreTrainedTokenizerFast``; bos = eos = ``<|endoftext|>``, pad = ``<|pad|>``)
    to ``out_dir`` and return the loaded fast tokenizer. Deterministic for the same texts and vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD, model_max_length=model_max_length,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    # transformers 5 writes its internal class name; name the public alias so older readers know it too.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = load_path(cfg_path)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return load_tokenizer(out_dir)


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained(path)`` (offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))

"""A tiny model with a real (character-level) tokenizer, and toy data files in the local layout.

Used by the tests and for quick demos of the evaluation plumbing without the shared data folder:
``save_tiny_with_tokenizer(arch, path)`` writes a tiny random model of ``arch``
(:mod:`expertcache.models.tiny`, vocabulary 128) plus a character tokenizer (printable ASCII and newline,
with ``" A"``..``" D"`` merged into single tokens for MMLU letter scoring); ``write_toy_data(root)``
writes ``wikitext-2-raw-v1/``, ``mmlu/`` and ``gsm8k/`` folders shaped like ``../shared/data``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["char_tokenizer", "save_tiny_with_tokenizer", "write_toy_data"]

_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3: the tiny configs' pad/bos/eos ids


def char_tokenizer():
    """A ``PreTrainedTokenizerFast`` over 104 ids: 4 specials, 96 characters, the merges ' A'..' D'."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(_SPECIALS + chars)}
    merges = [(" ", L) for L in "ABCD"]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def save_tiny_with_tokenizer(arch: str, path: str | os.PathLike, seed: int = 0) -> Path:
    """``expertcache.models.tiny.save_tiny`` plus :func:`char_tokenizer` saved next to it."""
    from expertcache.models.tiny import save_tiny

    path = save_tiny(arch, path, seed)
    char_tokenizer().save_pretrained(path)
    return path


_WORDS = ("the of and to in a is was for on as with by at from his that it an were are which this be "
          "river city music army game album song station church team season ship war film king").split()


def write_toy_data(root: str | os.PathLike, *, seed: int = 0, wikitext_rows: int = 60, mmlu_questions: int = 6,
                   gsm_problems: int = 6) -> Path:
    """Toy data in the shared layout under ``root`` (returned): WikiText rows of random words with headings and
    blank rows, two MMLU subjects (5 dev + ``mmlu_questions`` test each), GSM8K addition problems."""
    rng = random.Random(seed)
    root = Path(root)
    wt = root / "wikitext-2-raw-v1"
    wt.mkdir(parents=True, exist_ok=True)
    with open(wt / "test.jsonl", "w", encoding="utf-8") as f:
        for i in range(wikitext_rows):
            if i % 5 == 0:
                text = ""
            elif i % 5 == 1:
                text = f" = {rng.choice(_WORDS).title()} {i} = \n"
            else:
                text = " " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 30))) + " . \n"
            f.write(json.dumps({"text": text}) + "\n")
    header = "question,choice0,choice1,choice2,choice3,answer\n"
    for split, n in (("dev", 5), ("test", mmlu_questions)):
        (root / "mmlu" / split).mkdir(parents=True, exist_ok=True)
        for subject in ("toy_arithmetic", "toy_words"):
            lines = [header]
            for _ in range(n):
                a, b = rng.randint(1, 9), rng.randint(1, 9)
                ans = rng.randint(0, 3)
                choices = [str(a + b + d) for d in (-2, -1, 1, 2)]
                choices[ans] = str(a + b)
                lines.append(f"What is {a} + {b}?,{','.join(choices)},{ans}\n")
            (root / "mmlu" / split / f"{subject}_{split}.csv").write_text("".join(lines), encoding="utf-8")
    gsm = root / "gsm8k"
    gsm.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 8), ("test", gsm_problems)):
        with open(gsm / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for _ in range(n):
                a, b = rng.randint(1, 20), rng.randint(1, 20)
                q = f"Tom has {a} apples and buys {b} more. How many apples?"
                ans = f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"
                f.write(json.dumps({"question": q, "answer": ans}) + "\n")
    return root

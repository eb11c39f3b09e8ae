"""Local evaluation data: WikiText-2 (raw) test, MMLU dev/test, GSM8K train/test.

Everything is read from files (no network). The data folder is ``--data-dir DIR`` if given, else
``$EXPERTCACHE_DATA``, else ``<repo>/../shared/data``; it holds one sub-folder per data set:

- ``wikitext-2-raw-v1/test.jsonl``  one ``{"text": row}`` per line (the Hugging Face rows; blank rows are "");
- ``mmlu/dev/<subject>_dev.csv`` and ``mmlu/test/<subject>_test.csv`` with the header
  ``question,choice0,choice1,choice2,choice3,answer`` and ``answer`` an index 0-3 (the ``cais/mmlu`` layout);
- ``gsm8k/train.jsonl`` and ``gsm8k/test.jsonl``, rows ``{"question": str, "answer": str}`` whose answer
  ends with ``#### <number>``.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path

from expertcache.inputs import json_text_fields
from expertcache.train.data import data_root

__all__ = ["DATA_SETS", "resolve_eval_data_dir", "wikitext_text", "text_token_chunks", "MMLUQuestion", "load_mmlu", "GSMProblem",
           "load_gsm8k", "final_number"]

#: task name -> the sub-folder of the data folder it reads
DATA_SETS = {"wikitext": "wikitext-2-raw-v1", "mmlu": "mmlu", "gsm8k": "gsm8k"}


def resolve_eval_data_dir(task: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The folder of ``task``'s data set: ``<data_dir>/<sub-folder>`` (``data_dir`` defaults to
    ``$EXPERTCACHE_DATA``, else ``<repo>/../shared/data``). FileNotFoundError naming ``--data-dir`` and
    ``EXPERTCACHE_DATA`` when it is missing."""
    if task not in DATA_SETS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(DATA_SETS)}")
    path = data_root(data_dir) / DATA_SETS[task]
    if not path.is_dir():
        raise FileNotFoundError(
            f"{task} data not found: {path} does not exist. Pass --data-dir DIR or set EXPERTCACHE_DATA to the "
            f"data folder (the one holding {DATA_SETS[task]}/).")
    return path


def read_text_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file; ValueError naming the file (and line) if it is not UTF-8."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (undecodable byte at offset {exc.start})") from None


def wikitext_text(folder: Path) -> str:
    """The WikiText-2 raw test split as one blob: its rows joined by blank lines (``"\\n\\n".join(rows)``, the
    text of the Hugging Face perplexity guide and of 001's preprocessing)."""
    path = Path(folder) / "test.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (expected one {{\"text\": row}} per line)")
    rows = []
    for lineno, line in enumerate(read_text_lines(path), 1):
        if line.strip():
            rows.append(json_text_fields(line, ("text",), f"{path}:{lineno}")[0])  # a null / number: named
    return "\n\n".join(rows)


@dataclass(frozen=True)
class MMLUQuestion:
    subject: str  # e.g. "high_school_physics"
    question: str
    choices: tuple[str, str, str, str]
    answer: int  # 0..3


def _read_mmlu_csv(path: Path, subject: str) -> list[MMLUQuestion]:
    out = []
    with open(path, encoding="utf-8", newline="") as f:
        rows = _csv_rows(path, f)
        for i, row in enumerate(rows, 2):
            try:
                choices = tuple(row[f"choice{c}"] for c in range(4))
                answer = int(row["answer"])
                if not 0 <= answer <= 3:
                    raise ValueError(f"answer {answer} not in 0..3")
                out.append(MMLUQuestion(subject, row["question"], choices, answer))  # type: ignore[arg-type]
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: expected question,choice0..choice3,answer(0-3) ({exc})") from None
    if not out:  # every score would divide by 0 questions
        raise ValueError(f"{path}: no questions (the file is empty or holds only its header)")
    return out


def _csv_rows(path: Path, f) -> list[dict]:
    try:
        return list(csv.DictReader(f))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (undecodable byte at offset {exc.start})") from None
    except csv.Error as exc:
        raise ValueError(f"{path}: not a readable CSV file ({exc})") from None


def load_mmlu(folder: Path) -> tuple[dict[str, list[MMLUQuestion]], list[MMLUQuestion]]:
    """(dev exemplars by subject, test questions). Test questions are interleaved across subjects (the first
    question of every subject in sorted order, then the second, ...), so ``--limit N`` samples many subjects."""
    folder = Path(folder)
    dev = {p.name[: -len("_dev.csv")]: _read_mmlu_csv(p, p.name[: -len("_dev.csv")])
           for p in sorted((folder / "dev").glob("*_dev.csv"))}
    tests = {p.name[: -len("_test.csv")]: _read_mmlu_csv(p, p.name[: -len("_test.csv")])
             for p in sorted((folder / "test").glob("*_test.csv"))}
    if not dev or not tests:
        raise FileNotFoundError(f"{folder} needs dev/*_dev.csv and test/*_test.csv")
    interleaved = []
    depth = max(len(q) for q in tests.values())
    for j in range(depth):
        for subject in sorted(tests):
            if j < len(tests[subject]):
                interleaved.append(tests[subject][j])
    return dev, interleaved


@dataclass(frozen=True)
class GSMProblem:
    question: str
    answer: str  # worked solution ending with "#### <number>"
    target: str  # the normalised final number


_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def final_number(text: str) -> str | None:
    """The final numeric answer of a GSM8K solution: the number after the last ``####`` if there is one, else
    the last number in the text; normalised (no commas, '$' or trailing '.0'). None if there is no number."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    nums = _NUMBER.findall(text.replace("$", ""))
    if not nums:
        return None
    n = nums[-1].replace(",", "")
    if "." in n:
        n = n.rstrip("0").rstrip(".") or "0"
    return n


def load_gsm8k(folder: Path, split: str) -> list[GSMProblem]:
    """Rows of ``gsm8k/<split>.jsonl`` with calculator annotations (``<<a*b=c>>``) removed."""
    path = Path(folder) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    out = []
    for lineno, line in enumerate(read_text_lines(path), 1):
        if not line.strip():
            continue
        question, answer = json_text_fields(line, ("question", "answer"), f"{path}:{lineno}")
        answer = re.sub(r"<<[^>]*>>", "", answer)  # calculator annotations
        target = final_number(answer)
        if target is None:
            raise ValueError(f"{path}:{lineno}: expected {{question, answer ending in '#### N'}} (no final number)")
        out.append(GSMProblem(question, answer, target))
    return out


def text_token_chunks(path, source: str, chunks: int, seq: int = 256):
    """The first ``chunks`` × ``seq`` token ids, ``[chunks, seq]`` (torch int64), of an evaluation text encoded by
    the model folder ``path``'s tokenizer: ``source`` ``heldout`` (``offload.bench.heldout_stream``) or ``wikitext``
    (WikiText-2 test, ``tokenizer.json``, no special tokens). ValueError naming the text when it is shorter."""
    import torch

    if source == "wikitext":
        from tokenizers import Tokenizer

        body = wikitext_text(resolve_eval_data_dir("wikitext"))
        ids = Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(body, add_special_tokens=False).ids
    else:
        from expertcache.offload.bench import heldout_stream

        ids = heldout_stream(path).tolist()
    if len(ids) < chunks * seq:
        raise ValueError(f"the {source} text gives {len(ids)} tokens, fewer than {chunks} × {seq}")
    return torch.tensor(ids[:chunks * seq]).view(chunks, seq)

"""Closed-loop evaluation tasks: WikiText-2 perplexity, MMLU 5-shot accuracy, GSM8K 8-shot CoT exact match.

A task is built once (data read and tokenised) and run on a (patched) model; it only calls the model's
forward and marks the end of every sequence with ``patch.new_sequence()``, so the patch decides what the
cache does between sequences. Letter legend: S tokens of one sequence, V vocabulary.

Contracts:

- every evaluated item is one sequence (batch 1): a WikiText chunk, an MMLU prompt, a GSM8K prompt plus its
  generated answer; items run in data order;
- ``run`` returns ``{"quality": float, "items": int, ...}`` plus task-specific fields; ``quality`` is
  perplexity (lower is better) for WikiText, accuracy (higher) for MMLU and GSM8K;
- the context is ``min(1024, max_position_embeddings)`` tokens (001 uses 1024). Few-shot prompts that do not
  fit keep as many exemplars as fit (then, if even the zero-shot prompt is too long, its last tokens) and
  report the mean number of shots used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from expertcache.eval.data import (MMLUQuestion, final_number, load_gsm8k, load_mmlu, resolve_eval_data_dir,
                                   wikitext_text)

__all__ = ["TASKS", "Task", "WikiTextTask", "MMLUTask", "GSM8KTask", "build_task", "context_length",
           "greedy_generate"]

TASKS = ("wikitext", "mmlu", "gsm8k")
LETTERS = ("A", "B", "C", "D")


def context_length(model, cap: int = 1024) -> int:
    """Tokens per sequence: ``min(cap, config.max_position_embeddings)`` (001: 1024)."""
    n = getattr(model.config, "max_position_embeddings", None) or cap
    return int(min(cap, n))


def _bar(it, progress: bool, desc: str, total: int | None = None):
    from tqdm import tqdm

    return tqdm(it, desc=desc, total=total, unit="item", leave=False, disable=not progress)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])  # no max-length warning


@dataclass
class Task:
    """Base: ``name``, the quality metric and its direction, the default routing scope."""

    name: str = ""
    quality_name: str = ""
    higher_is_better: bool = True
    default_scope: str = "all"
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return dict(task=self.name, items=len(self), quality_name=self.quality_name, **self.info)


class WikiTextTask(Task):
    """WikiText-2 raw test perplexity with 001's preprocessing: the rows joined by blank lines into one blob,
    tokenised once, cut into consecutive non-overlapping chunks of ``context`` tokens (the last, partial
    chunk is dropped). Each chunk is one sequence; perplexity = exp(total NLL / predicted tokens) over all
    chunks (S − 1 predictions per chunk; no BOS is added)."""

    def __init__(self, tokenizer, *, context: int, data_dir=None, limit: int | None = None,
                 text: str | None = None) -> None:
        super().__init__(name="wikitext", quality_name="ppl", higher_is_better=False, default_scope="all")
        if text is None:
            text = wikitext_text(resolve_eval_data_dir("wikitext", data_dir))
        ids = torch.tensor(_encode(tokenizer, text), dtype=torch.long)
        n = ids.numel() // context
        if n == 0:
            raise ValueError(f"the text has {ids.numel()} tokens, fewer than one chunk of {context}")
        self.chunks_NS = ids[: n * context].view(n, context)  # [N, S]
        if limit:
            self.chunks_NS = self.chunks_NS[:limit]
        self.info = dict(context=context, tokens=int(self.chunks_NS.numel()), total_chunks=n)

    def __len__(self) -> int:
        return int(self.chunks_NS.shape[0])

    @torch.no_grad()
    def run(self, model, patch=None, *, progress: bool = False) -> dict[str, Any]:
        device = next(model.parameters()).device
        nll, count = 0.0, 0
        for chunk_S in _bar(self.chunks_NS, progress, "wikitext", len(self)):
            x_1S = chunk_S[None].to(device)
            logits_1SV = model(input_ids=x_1S, use_cache=False).logits
            check_finite(logits_1SV, "in a wikitext chunk")
            nll += float(torch.nn.functional.cross_entropy(logits_1SV[0, :-1].float(), x_1S[0, 1:],
                                                           reduction="sum"))
            count += x_1S.shape[1] - 1
            if patch is not None:
                patch.new_sequence()
        return dict(quality=math.exp(nll / count), nll=nll / count, items=len(self), predicted_tokens=count)


def check_finite(logits: torch.Tensor, where: str) -> None:
    """ValueError when ``logits`` hold NaN or inf (non-finite weights or activations): a run must stop with a
    message rather than report a NaN quality or decode garbage."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"non-finite logits (NaN/inf) {where}: the model's weights or activations are not "
                         "finite; check the checkpoint")


def _fit_prompt(tokenizer, parts: list[str], question: str, budget: int) -> tuple[list[int], int]:
    """Token ids of ``"".join(parts[:k]) + question`` for the largest k that fits ``budget`` tokens (the last
    ``budget`` tokens of the k = 0 prompt if nothing fits), and k."""
    for k in range(len(parts), -1, -1):
        ids = _encode(tokenizer, "".join(parts[:k]) + question)
        if len(ids) <= budget:
            return ids, k
    return ids[-budget:], 0


class MMLUTask(Task):
    """MMLU k-shot (default 5) multiple choice: the subject's dev questions are the exemplars, in the format of
    Hendrycks et al.; the prediction is the letter (``" A"``..``" D"``, one token each) with the highest
    next-token log-likelihood after ``"Answer:"``; quality = accuracy. Test questions are interleaved across
    subjects (see :func:`expertcache.eval.data.load_mmlu`)."""

    def __init__(self, tokenizer, *, context: int, data_dir=None, limit: int | None = None, shots: int = 5) -> None:
        super().__init__(name="mmlu", quality_name="accuracy", higher_is_better=True, default_scope="all")
        dev, test = load_mmlu(resolve_eval_data_dir("mmlu", data_dir))
        if limit:
            test = test[:limit]
        base = _encode(tokenizer, "Answer:")
        self.letter_ids = []
        for letter in LETTERS:
            ids = _encode(tokenizer, "Answer: " + letter)
            if ids[: len(base)] != base or len(ids) != len(base) + 1:
                raise ValueError(f"the tokenizer does not encode the answer letter ' {letter}' after 'Answer:' as "
                                 "one token; MMLU letter scoring needs it")
            self.letter_ids.append(ids[-1])
        self.prompts: list[list[int]] = []
        self.answers: list[int] = []
        shots_used = []
        for q in test:
            subject = q.subject.replace("_", " ")
            head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
            parts = [head + self._format(e, True) if i == 0 else self._format(e, True)
                     for i, e in enumerate(dev.get(q.subject, [])[:shots])]
            question = self._format(q, False) if parts else head + self._format(q, False)
            ids, k = _fit_prompt(tokenizer, parts, question, context)
            self.prompts.append(ids)
            self.answers.append(q.answer)
            shots_used.append(k)
        self.info = dict(context=context, shots=shots,
                         mean_shots=sum(shots_used) / max(1, len(shots_used)),
                         subjects=len({q.subject for q in test}))

    @staticmethod
    def _format(q: MMLUQuestion, with_answer: bool) -> str:
        text = q.question.strip() + "\n" + "".join(f"{L}. {c}\n" for L, c in zip(LETTERS, q.choices)) + "Answer:"
        return text + f" {LETTERS[q.answer]}\n\n" if with_answer else text

    def __len__(self) -> int:
        return len(self.prompts)

    def score(self, logits_V: torch.Tensor, answer: int) -> tuple[int, float]:
        """(predicted answer index 0-3, log-probability of the right letter ``answer``) of the next-token logits [V]
        after one prompt: the prediction is the letter whose token has the highest log-probability, a
        log-probability over the whole vocabulary (not renormalised over the four letters). The one scoring of :meth:`run` and
        of callers that compute the logits themselves (``benchmarks/bench_mixed.py mmlu``: token by token
        through the offloaded runtime). ValueError on non-finite logits."""
        check_finite(logits_V, "in an mmlu question")
        logp_4 = torch.log_softmax(logits_V.float(), dim=-1)[self.letter_ids]
        return int(logp_4.argmax()), float(logp_4[answer])

    @torch.no_grad()
    def run(self, model, patch=None, *, progress: bool = False) -> dict[str, Any]:
        device = next(model.parameters()).device
        correct, loglik = 0, 0.0
        for ids, answer in _bar(list(zip(self.prompts, self.answers)), progress, "mmlu", len(self)):
            logits_V = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1]
            predicted, logp = self.score(logits_V, answer)
            correct += int(predicted == answer)
            loglik += logp
            if patch is not None:
                patch.new_sequence()
        n = len(self)
        return dict(quality=correct / n, correct=correct, items=n, mean_answer_loglik=loglik / n)


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int, *, stop_texts=(), tokenizer=None,
                    eos_id: int | None = None) -> list[int]:
    """Greedy decoding with the KV cache: one prefill call (all prompt tokens), then one call per new token
    (the decoding steps a ``scope='generation'`` patch applies its policy to). Stops after
    ``max_new_tokens``, at ``eos_id``, or once the decoded continuation contains one of ``stop_texts``."""
    from expertcache.models.cachearg import cache_kw, out_cache

    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True)
    past = out_cache(out)
    new: list[int] = []
    for step in range(max_new_tokens):
        check_finite(out.logits[0, -1], f"at generation step {step}")
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        if tok == eos_id:
            break
        if stop_texts and any(s in tokenizer.decode(new) for s in stop_texts):
            break
        if step == max_new_tokens - 1:
            break
        out = model(input_ids=torch.tensor([[tok]], device=device), **cache_kw(past), use_cache=True)
        past = out_cache(out)
    return new


class GSM8KTask(Task):
    """GSM8K k-shot (default 8) chain of thought: the first k training problems (worked solutions ending in
    ``#### N``, calculator annotations removed) as exemplars in ``"Question: ...\\nAnswer: ...\\n\\n"`` form;
    greedy generation of at most ``max_new_tokens`` (capped at half the context), stopping at a blank line,
    ``"Question:"`` or EOS; exact match of the final number (after ``####`` if generated, else the last
    number). Default scope 'generation': the policy acts only on decoding steps (001 Sec. 4.2)."""

    STOP = ("\n\n", "Question:")

    def __init__(self, tokenizer, *, context: int, data_dir=None, limit: int | None = None, shots: int = 8,
                 max_new_tokens: int = 256) -> None:
        super().__init__(name="gsm8k", quality_name="accuracy", higher_is_better=True, default_scope="generation")
        folder = resolve_eval_data_dir("gsm8k", data_dir)
        exemplars = load_gsm8k(folder, "train")[:shots]
        test = load_gsm8k(folder, "test")
        if limit:
            test = test[:limit]
        self.tokenizer = tokenizer
        self.max_new_tokens = max(1, min(max_new_tokens, context // 2))
        parts = [f"Question: {e.question}\nAnswer: {e.answer}\n\n" for e in exemplars]
        self.prompts, self.targets, shots_used = [], [], []
        for p in test:
            ids, k = _fit_prompt(tokenizer, parts, f"Question: {p.question}\nAnswer:", context - self.max_new_tokens)
            self.prompts.append(ids)
            self.targets.append(p.target)
            shots_used.append(k)
        self.eos_id = tokenizer.eos_token_id
        self.info = dict(context=context, shots=shots, max_new_tokens=self.max_new_tokens,
                         mean_shots=sum(shots_used) / max(1, len(shots_used)))

    def __len__(self) -> int:
        return len(self.prompts)

    def run(self, model, patch=None, *, progress: bool = False) -> dict[str, Any]:
        correct, generated, predictions = 0, 0, []
        generated_mask: list[bool] = []  # per recorded token: produced by a decoding step
        for ids, target in _bar(list(zip(self.prompts, self.targets)), progress, "gsm8k", len(self)):
            new = greedy_generate(model, ids, self.max_new_tokens, stop_texts=self.STOP, tokenizer=self.tokenizer,
                                  eos_id=self.eos_id)
            text = self.tokenizer.decode(new)
            for s in self.STOP:
                text = text.split(s)[0]
            pred = final_number(text)
            correct += int(pred == target)
            predictions.append(pred)
            generated += len(new)
            # the model saw the prompt (prefill) and every new token but the last one
            generated_mask += [False] * len(ids) + [True] * (len(new) - 1)
            if patch is not None:
                patch.new_sequence()
        n = len(self)
        return dict(quality=correct / n, correct=correct, items=n, generated_tokens=generated,
                    generated_mask=generated_mask, predictions=predictions)


def build_task(name: str, tokenizer, *, context: int, data_dir=None, limit: int | None = None, **kw) -> Task:
    """The task ``name`` (one of ``TASKS``) with its data read and tokenised."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit (--limit) must be a whole number ≥ 1, got {limit!r}")
    if name == "wikitext":
        return WikiTextTask(tokenizer, context=context, data_dir=data_dir, limit=limit)
    if name == "mmlu":
        return MMLUTask(tokenizer, context=context, data_dir=data_dir, limit=limit,
                        **{k: v for k, v in kw.items() if k == "shots" and v is not None})
    if name == "gsm8k":
        return GSM8KTask(tokenizer, context=context, data_dir=data_dir, limit=limit,
                         **{k: v for k, v in kw.items() if k in ("shots", "max_new_tokens") and v is not None})
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")

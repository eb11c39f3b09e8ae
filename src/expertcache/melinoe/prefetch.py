"""MELINOE's post-deployment step (004 Sec. 3.2): before decoding, load the Top-C experts of the predictor's
output per layer (a batch pools its rows' predictions, 004 Sec. 4). Prefetch loads are counted apart from
demand misses -- the cache statistics (accesses, hits, misses) are those of the demand requests -- and every
report adds them back: transfers = demand misses + prefetch loads (eval rows: ``transfers``,
``transfers_per_token_layer``, and ``net_transfers`` against the same requests replayed without prefetching).

- offloaded runtime (``generate``, ``bench``): :func:`prefetch_runtime` calls the public
  :meth:`OffloadedModel.prefetch` per layer;
- closed-loop eval (``eval``): :class:`PatchPrefetcher` loads each task item's predicted set into the live
  caches of a :class:`expertcache.models.patch.MoEPatch` before the item runs.
"""

from __future__ import annotations

import numpy as np

from expertcache.cache import ExpertCache

__all__ = ["check_compatible", "prefetch_cache", "prefetch_runtime", "item_prompt_texts", "PatchPrefetcher",
           "predictor_recall"]


def check_compatible(predictor, num_layers: int, num_experts: int, where: str = "the model") -> None:
    if (predictor.num_layers, predictor.num_experts) != (num_layers, num_experts):
        raise ValueError(f"--predictor predicts [L={predictor.num_layers}, E={predictor.num_experts}] but {where} has "
                         f"L={num_layers} MoE layers of E={num_experts} experts (train one with `expertcache "
                         "melinoe predictor --model ...`)")


prefetch_cache = ExpertCache.prefetch  # load a set into one cache, counted apart from demand misses


def prefetch_runtime(rt, predictor, texts: list[str], tok=None) -> int:
    """Prefetch the pooled Top-C of ``predictor`` on ``texts`` into every layer of the offloaded runtime ``rt``
    (call after ``configure``/``warm``, before ``generate``). Returns the number of experts loaded."""
    check_compatible(predictor, len(rt.layers), rt.num_experts)
    sets = predictor.prefetch_sets(texts, rt.capacity, rt.model, tok)
    return sum(rt.prefetch(li, ids) for li, ids in enumerate(sets))


def item_prompt_texts(task, tok, prompt_len: int) -> list[str]:
    """The text the predictor sees for each task item: a WikiText chunk's first ``prompt_len`` tokens (what
    precedes the rest of the chunk), an MMLU/GSM8K item's prompt."""
    if hasattr(task, "chunks_NS"):
        return [tok.decode(row[:prompt_len].tolist()) for row in task.chunks_NS]
    if hasattr(task, "prompts"):
        return [tok.decode(list(p)) for p in task.prompts]
    raise ValueError(f"--predictor: task {getattr(task, 'name', task)!r} exposes no per-item prompts")


class PatchPrefetcher:
    """Prefetch each item's predicted Top-C into a patch's live caches before the item runs (item i's set
    before the first item, then after each ``new_sequence``). ``loaded`` counts the prefetch loads."""

    def __init__(self, predictor, texts: list[str], model=None, tok=None) -> None:
        self.predictor = predictor
        self.scores = predictor.predict(texts, model, tok)  # [N, L, E]
        self.loaded = 0
        self.items = 0

    def install(self, patch) -> "PatchPrefetcher":
        check_compatible(self.predictor, len(patch.layers), patch.num_experts)
        if patch.capacity is None:
            raise ValueError("--predictor needs an expert cache (a capacity)")
        self._patch = patch
        patch.on_new_sequence(self._load_next)
        self._load_next()
        return self

    def _load_next(self) -> None:
        if self.items >= len(self.scores):
            return
        c = self._patch.capacity
        pred = self.scores[self.items]
        self.items += 1
        caches = self._patch.caches
        for li, cache in enumerate(caches):
            self.loaded += cache.prefetch(np.argsort(-pred[li], kind="stable")[:c].tolist())

    def summary(self) -> dict:
        out = dict(prefetched=self.loaded, prefetched_items=self.items)
        return {**out, **predictor_recall(self.predictor, self._patch.capacity)}


def predictor_recall(predictor, capacity: int) -> dict:
    """The predictor's held-out top-C recall at ``capacity`` against the frequency prior's (from its training
    report, ``melinoe predictor``); empty when it was not measured at that C."""
    rep = predictor.meta.get("heldout_report", {}).get("topc", {}).get(str(capacity))
    if rep is None:
        return {}
    return dict(predictor_recall=rep["predictor"]["recall"], prior_recall=rep["prior"]["recall"],
                predictor_beats_prior=bool(rep["predictor"]["recall"] > rep["prior"]["recall"]))

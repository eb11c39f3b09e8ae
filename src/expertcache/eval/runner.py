"""Closed-loop evaluation: a task run on the patched model, reported as one result row.

:func:`evaluate` patches the model (policy + one live cache per MoE layer, recording on), runs the task,
unpatches, and returns a JSON-serialisable row with

- the quality (``quality``, ``quality_name``, ``higher_is_better``) and the task's own counters (``task_metrics``);
- the live cache statistics (``miss_rate`` = misses / (tokens · L · K), ``mean_lifetime`` in tokens,
  per-layer breakdown) from :meth:`MoEPatch.stats` -- every token the model processed counts, prompt
  tokens included;
- ``belady_miss_rate``: Belady's optimal eviction replayed on the *same recorded selections* (the offline
  bound of a lossless cache for what this run actually requested);
- for tasks that generate (GSM8K): ``generation_miss_rate``, the miss rate over decoding steps only;
- the full resolved config (patch, task, data), the package version and the seed.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from expertcache import __version__
from expertcache.cache import DEFAULT_GAMMA
from expertcache.eval.tasks import Task, build_task, context_length
from expertcache.eval.timeline import step_misses
from expertcache.models.loader import load_model, load_tokenizer_checked, resolve_model_path
from expertcache.routing import RoutingConfig

__all__ = ["resolve_model_path", "load_model_and_tokenizer", "evaluate", "prepare"]


def load_model_and_tokenizer(spec: str):
    """(model in eval mode, float32; tokenizer) of a shipped model name or a checkpoint folder."""
    path = resolve_model_path(spec)
    tok = load_tokenizer_checked(path)  # a missing or broken tokenizer fails before the weights are read
    try:
        model = load_model(path)
    except OSError as exc:
        raise FileNotFoundError(f"cannot load model {spec!r}: not a checkpoint folder, a shipped model (granular, "
                                f"coarse) or a reachable hub name ({str(exc).splitlines()[0]})") from None
    return model, tok


def prepare(model_spec: str, task: str, *, data_dir=None, limit: int | None = None, device=None, **task_kw):
    """(model, tokenizer, task) ready for :func:`evaluate`; the model on ``device`` (default: the CPU; the tasks
    put their inputs on the model's device, routing decisions run on the CPU, see :mod:`expertcache.models.patch`)."""
    from expertcache.eval.data import resolve_eval_data_dir

    resolve_eval_data_dir(task, data_dir)  # a missing data folder fails before the model is loaded
    model, tok = load_model_and_tokenizer(model_spec)
    if device is not None:
        model.to(device)
    t = build_task(task, tok, context=context_length(model), data_dir=data_dir, limit=limit, **task_kw)
    return model, tok, t


def evaluate(model, task: Task, routing: RoutingConfig, *, eviction: str = "lru", capacity="0.5",
             gamma: float = DEFAULT_GAMMA, initial: str | None = None, seed: int = 0, between_sequences: str = "carry",
             scope: str | None = None, freq_LE=None, replace_rank: int | None = None, progress: bool = False,
             trace_out: str | None = None, model_name: str | None = None, prefetch=None,
             router_hook=None) -> dict[str, Any]:
    """Run ``task`` on ``model`` under ``routing`` with live caches; returns the result row (module docstring).
    ``scope`` defaults to the task's (GSM8K: 'generation', else 'all'); ``trace_out`` also saves the recorded
    routing trace there. ``prefetch(patch, task)`` (MELINOE) installs prefetching into the patch before the task
    runs and returns an object whose ``summary()`` (prefetch counts) is added to the row. ``router_hook(patch)``,
    called once the model is patched, may replace the patch's router (budget-targeted routing:
    :func:`expertcache.routing.budget.attach`); an object it returns with a ``state()`` method is reported as the
    row's ``controller``."""
    from expertcache.models import patch_model
    from expertcache.sim import replay

    t0 = time.perf_counter()
    scope = scope or task.default_scope
    init = None if initial in (None, "empty") else initial
    with patch_model(model, routing, eviction=eviction, capacity=capacity, scope=scope,
                     between_sequences=between_sequences, initial=init, seed=seed, gamma=gamma, record=True,
                     freq_LE=freq_LE, replace_rank=replace_rank) as patch:
        hooked = router_hook(patch) if router_hook is not None else None
        pre = prefetch(patch, task) if prefetch is not None else None
        out = task.run(model, patch, progress=progress)
        stats = patch.stats()
        trace = patch.trace()
    meta = trace.meta
    row = stats.to_row()
    belady = replay(trace.ids_TLK, meta.num_experts, patch.capacity, eviction="belady", initial=init, seed=seed,
                    sequence_starts=meta.sequence_starts, between_sequences=between_sequences)
    row["belady_miss_rate"] = belady.miss_rate
    row["belady_layer_miss_rates"] = belady.layer_miss_rates()
    gen_mask = out.pop("generated_mask", None)
    if gen_mask is not None:
        mask_T = np.asarray(gen_mask, dtype=bool)
        if mask_T.shape[0] != trace.num_tokens:
            raise RuntimeError(f"task marked {mask_T.shape[0]} tokens, the trace has {trace.num_tokens}")
        misses_TL = step_misses(trace.ids_TLK, meta.num_experts, patch.capacity, eviction=eviction, gamma=gamma,
                                initial=init, seed=seed, sequence_starts=meta.sequence_starts,
                                between_sequences=between_sequences)
        n_gen = int(mask_T.sum())
        row["generation_miss_rate"] = (float(misses_TL[mask_T].sum()) / (n_gen * meta.num_layers * meta.top_k)
                                       if n_gen else None)
        row["generation_tokens"] = n_gen
    if trace_out:
        trace.meta.extra["task"] = task.describe()
        trace.save(trace_out)
    config = dict(row["config"])
    config.update(task=task.describe(), model=model_name or config.get("model", ""))
    quality = out.pop("quality")
    row.update(kind="eval", mode="closed-loop", version=__version__, seed=seed, config=config, task=task.name,
               quality_name=task.quality_name, quality=quality, higher_is_better=task.higher_is_better,
               task_metrics=out, seconds=time.perf_counter() - t0)
    if pre is not None:
        row.update(pre.summary())
    # every expert load: demand misses and (MELINOE --predictor) prefetch loads; per token per MoE layer
    row["transfers"] = int(row["misses"]) + int(row.get("prefetched", 0))
    row["transfers_per_token_layer"] = row["transfers"] / max(1, row["tokens"] * meta.num_layers)
    if pre is not None:  # what prefetching earned: the same selections replayed without the prefetched sets
        plain = replay(trace.ids_TLK, meta.num_experts, patch.capacity, eviction=eviction, gamma=gamma, initial=init,
                       seed=seed, sequence_starts=meta.sequence_starts, between_sequences=between_sequences)
        row["misses_without_prefetch"] = int(plain.overall.misses)
        row["net_transfers"] = row["transfers"] - row["misses_without_prefetch"]  # < 0: prefetch saved loads
    if hasattr(hooked, "state"):
        row["controller"] = hooked.state()
    return row

"""Closed-loop evaluation of cache-aware routing inside real models, sweeps and reports.

- :mod:`expertcache.eval.data` -- local WikiText-2 / MMLU / GSM8K files (``--data-dir``, ``EXPERTCACHE_DATA``);
- :mod:`expertcache.eval.tasks` -- the tasks (perplexity, 5-shot letter accuracy, 8-shot CoT exact match);
- :mod:`expertcache.eval.runner` -- :func:`evaluate`: one task on the patched model -> one result row;
- :mod:`expertcache.eval.timeline` -- per-token hit/miss events (generation-only miss rate, rasters);
- :mod:`expertcache.eval.sweep` -- policy × strength × cache size × eviction grids, resumable JSONL;
- :mod:`expertcache.eval.report` -- Pareto tables and the figures (001 Fig. 2, 4, 7, 9, 10);
- :mod:`expertcache.eval.synthetic` -- a tiny model with a character tokenizer and toy data files (tests, demos).
"""

from expertcache.eval.runner import evaluate, load_model_and_tokenizer, prepare, resolve_model_path
from expertcache.eval.tasks import TASKS, build_task, context_length

__all__ = ["evaluate", "load_model_and_tokenizer", "prepare", "resolve_model_path", "TASKS", "build_task",
           "context_length"]

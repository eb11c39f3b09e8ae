"""Adapters to tools expertcache users already run (optional extras): :mod:`expertcache.integrations.lm_eval`
(lm-evaluation-harness model ``expertcache``)."""

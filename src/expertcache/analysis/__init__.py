"""Activation profiling of routing traces (003 MoE-ERAS section IV-A): per-layer activation frequency
(Fig. 3), inter-layer router correlation (Fig. 4), distinct experts vs batch size (Fig. 6), and the ERAS
biasing profile on disk. numpy (+ matplotlib for :mod:`expertcache.analysis.plots`); no transformers.

:func:`analyze` runs everything on one trace and returns the arrays and a JSON-ready summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from expertcache.analysis.profile import PROFILE_SUFFIXES, load_freq, load_profile, profile_of, save_profile
from expertcache.analysis.profiling import (activation_frequency, activation_rate, distinct_experts,
                                            expert_correlation, layer_correlation, router_signal, summarize,
                                            top_pairs, uniform_distinct)

__all__ = ["Analysis", "analyze", "activation_frequency", "activation_rate", "router_signal",
           "expert_correlation", "layer_correlation", "top_pairs", "distinct_experts", "uniform_distinct",
           "PROFILE_SUFFIXES", "profile_of", "save_profile", "load_profile", "load_freq"]

#: Above this many (layer, expert) features the full correlation matrix is not kept (F² float64).
MAX_FULL_CORRELATION = 4096


@dataclass
class Analysis:
    """Everything :func:`analyze` computes for one trace."""

    freq_LE: np.ndarray
    rate_LE: np.ndarray
    corr_FF: np.ndarray | None
    layer_corr_LL: np.ndarray
    distinct_BL: np.ndarray
    summary: dict[str, Any] = field(default_factory=dict)


def analyze(trace, *, signal: str = "probs", max_batch: int = 32, batch_mode: str = "random",
            samples: int = 256, seed: int = 0, top_n: int = 10, progress: bool = False) -> Analysis:
    """Profile a :class:`~expertcache.trace.RoutingTrace`: frequency, correlation (of ``signal``, see
    :func:`router_signal`), distinct experts for batch sizes 1..``max_batch`` (``batch_mode``, see
    :func:`distinct_experts`). The summary records the configuration and the trace's metadata."""
    m = trace.meta
    l, e, k = trace.num_layers, m.num_experts, m.top_k
    freq = activation_frequency(trace.ids_TLK, e)
    rate = activation_rate(trace.ids_TLK, e)
    x = router_signal(trace.logits_TLE, trace.ids_TLK, signal=signal, scoring=m.scoring)
    if l * e <= MAX_FULL_CORRELATION:
        corr = expert_correlation(x)
        layer_corr = layer_correlation(corr, l)
        pairs = top_pairs(corr, l, n=top_n)
    else:  # block by block: [L, L] summary only
        corr, pairs = None, []
        layer_corr = np.full((l, l), np.nan)
        for a in range(l):
            for b in range(a, l):
                s = layer_correlation(expert_correlation(x[:, sorted({a, b}), :]), len({a, b}))  # a == b: [1, 1]
                layer_corr[a, b], layer_corr[b, a] = s[0, -1], s[-1, 0]
    distinct = distinct_experts(trace.ids_TLK, e, max_batch, mode=batch_mode, samples=samples, seed=seed,
                                sequence_starts=m.sequence_starts, progress=progress)
    summary = {
        "trace": {"model": m.model, "source": m.source, "tokens": trace.num_tokens, "num_layers": l,
                  "num_experts": e, "top_k": k, "scoring": m.scoring, "layer_ids": m.layer_ids,
                  "sequences": len(m.sequence_starts or [0])},
        "config": {"signal": signal, "max_batch": max_batch, "batch_mode": batch_mode, "samples": samples,
                   "seed": seed},
        **summarize(freq, rate, layer_corr, pairs, distinct, k),
    }
    return Analysis(freq, rate, corr, layer_corr, distinct, summary)

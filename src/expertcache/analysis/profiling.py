"""Activation profiling of a routing trace (003 MoE-ERAS section III-A / IV-A, Fig. 3, 4 and 6).

Pure numpy functions of a trace's selections ``ids_TLK`` and router logits ``logits_TLE``.

Letter legend: T tokens, L MoE layers, E experts (N in the papers), K experts selected per token, B the
largest batch size studied, F = L·E (one feature per expert of every layer).

- :func:`activation_rate` -- [L, E] share of tokens whose top-K at layer l contains expert e (rows sum to K).
- :func:`activation_frequency` (:mod:`expertcache.sim`) -- [L, E] share of a layer's selections that go to e (rows sum to 1; uniform
  routing gives 1/E). This is 003 Fig. 3's per-layer normalisation and the ERAS-biasing profile ``freq``.
- :func:`router_signal` -- [T, L, E] per-token router probabilities (softmax over E, or sigmoid for
  sigmoid-scored models) or 0/1 selection indicators: the variables correlated below.
- :func:`expert_correlation` -- [F, F] Pearson correlation across tokens between every pair of (layer,
  expert) features (003 Fig. 4).
- :func:`layer_correlation` -- [L, L] summary of it: how well the best-matching single expert of layer m
  tracks the experts of layer l.
- :func:`distinct_experts` -- [B, L] mean number of distinct experts a batch of b tokens requests at each
  layer (003 Fig. 6).

Dropped slots (id -1, pruning baseline) never count as an activation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from expertcache.sim.simulator import activation_frequency, check_selections, selection_counts, sequence_segments

__all__ = ["activation_rate", "activation_frequency", "router_signal", "expert_correlation",
           "layer_correlation", "top_pairs", "distinct_experts", "uniform_distinct", "summarize"]

SIGNALS = ("probs", "selected")
BATCH_MODES = ("random", "consecutive")


def activation_rate(ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] float64: the fraction of the T tokens whose selection at layer l includes expert e.

    Rows sum to K (less where slots were dropped); uniform routing gives K/E everywhere.
    """
    t = np.asarray(ids_TLK).shape[0]
    return selection_counts(ids_TLK, num_experts) / max(t, 1)


def router_signal(logits_TLE: np.ndarray, ids_TLK: np.ndarray | None = None, *, signal: str = "probs",
                  scoring: str = "softmax") -> np.ndarray:
    """[T, L, E] float64 per-token variables whose correlations :func:`expert_correlation` measures.

    signal='probs': the router probabilities, softmax over the E logits of each layer (003 IV-A: "apply the
        softmax function, and build a correlation matrix"); sigmoid of each logit when ``scoring='sigmoid'``.
    signal='selected': 1.0 where expert e is among the token's selected ids at layer l, else 0.0.
    """
    if signal not in SIGNALS:
        raise ValueError(f"signal must be one of {SIGNALS}, got {signal!r}")
    z = np.asarray(logits_TLE, dtype=np.float64)
    if z.ndim != 3:
        raise ValueError(f"logits must be [T, L, E], got shape {z.shape}")
    t, l, e = z.shape
    if signal == "selected":
        if ids_TLK is None:
            raise ValueError("signal='selected' needs the selections ids_TLK")
        ids = check_selections(ids_TLK, e).astype(np.int64, copy=False)
        out = np.zeros((t, l, e + 1))  # column E swallows dropped slots (-1)
        np.put_along_axis(out, np.where(ids >= 0, ids, e), 1.0, axis=2)
        return out[..., :e]
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    z = z - z.max(axis=2, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=2, keepdims=True)


def expert_correlation(x_TLE: np.ndarray) -> np.ndarray:
    """[F, F] Pearson correlation coefficients (F = L·E, feature f = l·E + e) across the T tokens between
    the per-token variables ``x_TLE`` (see :func:`router_signal`) of every pair of (layer, expert).

    This is 003 Fig. 4: block (l, m) holds the correlations between the experts of layer l and those of
    layer m; diagonal blocks are within-layer. A feature that is constant over the trace (e.g. an expert
    that is never selected) has no defined correlation: its row and column are NaN (the diagonal too).
    Memory is F² float64 (128 MB at F = 4096); use :func:`layer_correlation` alone for larger models.
    """
    x = np.asarray(x_TLE, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"expected [T, L, E], got shape {x.shape}")
    t, l, e = x.shape
    x_TF = x.reshape(t, l * e)
    zc_TF = x_TF - x_TF.mean(axis=0)
    std_F = np.sqrt((zc_TF ** 2).mean(axis=0))
    ok_F = std_F > 1e-12 * np.maximum(1.0, np.abs(x_TF).max(axis=0))
    zs_TF = zc_TF / np.where(ok_F, std_F, 1.0)
    corr = zs_TF.T @ zs_TF / max(t, 1)
    np.clip(corr, -1.0, 1.0, out=corr)
    corr[~ok_F, :] = np.nan
    corr[:, ~ok_F] = np.nan
    return corr


def layer_correlation(corr_FF: np.ndarray, num_layers: int) -> np.ndarray:
    """[L, L] summary of :func:`expert_correlation`: ``S[l, m]`` = the mean, over the experts i of layer l
    that vary, of max_j |corr(expert i of layer l, expert j of layer m)| (j ≠ i when l = m).

    S[l, m] = 1 when every expert of layer l is mirrored (or anti-mirrored) by one expert of layer m, e.g.
    when layer m's selections copy layer l's under any relabelling; it is ≈ 0 for independent layers (up to
    sampling noise ~ 1/sqrt(T)). Not symmetric: it averages over the experts of the row layer. NaN where a
    layer has no varying expert.
    """
    corr = np.abs(np.asarray(corr_FF, dtype=np.float64))
    f = corr.shape[0]
    if corr.shape != (f, f) or f % num_layers:
        raise ValueError(f"correlation matrix {corr.shape} does not split into {num_layers} layers")
    e = f // num_layers
    blocks = corr.reshape(num_layers, e, num_layers, e).transpose(0, 2, 1, 3).copy()  # [L, L, E, E]
    for layer in range(num_layers):
        np.fill_diagonal(blocks[layer, layer], np.nan)
    with np.errstate(all="ignore"):
        valid = ~np.isnan(blocks).all(axis=3)                                # [L, L, E]
        best = np.where(valid, np.nanmax(np.where(np.isnan(blocks), -np.inf, blocks), axis=3), np.nan)
        return np.nanmean(np.where(np.isinf(best), np.nan, best), axis=2)


def top_pairs(corr_FF: np.ndarray, num_layers: int, n: int = 10, cross_layer: bool = True) -> list[dict[str, Any]]:
    """The ``n`` (layer, expert) pairs with the largest |correlation| (each unordered pair once; only pairs
    from different layers when ``cross_layer``), as JSON-ready dicts."""
    corr = np.asarray(corr_FF, dtype=np.float64)
    f = corr.shape[0]
    e = f // num_layers
    iu, ju = np.triu_indices(f, k=1)
    vals = corr[iu, ju]
    keep = ~np.isnan(vals)
    if cross_layer:
        keep &= (iu // e) != (ju // e)
    iu, ju, vals = iu[keep], ju[keep], vals[keep]
    order = np.argsort(-np.abs(vals), kind="stable")[:n]
    return [{"layer_a": int(iu[o] // e), "expert_a": int(iu[o] % e), "layer_b": int(ju[o] // e),
             "expert_b": int(ju[o] % e), "corr": float(vals[o])} for o in order]


def _windows(b: int, num_tokens: int, sequence_starts: list[int] | None) -> np.ndarray:
    """Start positions of the non-overlapping windows of b consecutive tokens inside one sequence."""
    out = [np.arange(s, e - b + 1, b) for s, e in sequence_segments(num_tokens, sequence_starts, "reset")
           if e - s >= b]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def distinct_experts(ids_TLK: np.ndarray, num_experts: int, max_batch: int, *, mode: str = "random",
                     samples: int = 256, seed: int = 0,
                     sequence_starts: list[int] | None = None, progress: bool = False) -> np.ndarray:
    """[B, L] float64: row b-1 is the mean number of distinct experts requested at each layer by a batch of
    b tokens (the union of their selected ids), for b = 1..``max_batch`` (003 Fig. 6).

    mode='random': ``samples`` batches of b distinct tokens drawn uniformly from the whole trace (seeded) --
        b independent sequences decoded together, 003's batched-decoding setting.
    mode='consecutive': every non-overlapping window of b consecutive tokens within one sequence (a prefill
        chunk of one sequence); NaN where no sequence has b tokens.

    Batch size 1 gives exactly K (fewer only where slots were dropped); the value never exceeds
    min(E, b·K). Compare with :func:`uniform_distinct` (independent uniform routing).
    """
    if mode not in BATCH_MODES:
        raise ValueError(f"mode must be one of {BATCH_MODES}, got {mode!r}")
    ids = check_selections(ids_TLK, num_experts).astype(np.int64, copy=False)
    t, l, k = ids.shape
    if max_batch < 1:
        raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
    if t == 0:
        raise ValueError("the trace has no tokens")
    rng = np.random.default_rng(seed)
    out = np.full((max_batch, l), np.nan)
    ids_flat = np.where(ids >= 0, ids, num_experts)  # [T, L, K]; dropped -> spare column E
    from tqdm import tqdm

    for b in tqdm(range(1, max_batch + 1), desc="distinct experts", unit="batch size", disable=not progress,
                  leave=False):
        if mode == "random":
            if b > t:
                continue
            tok_NB = np.stack([rng.choice(t, size=b, replace=False) for _ in range(samples)])
        else:
            w = _windows(b, t, sequence_starts)
            if w.size == 0:
                continue
            tok_NB = w[:, None] + np.arange(b)[None, :]
        sel_NBLK = ids_flat[tok_NB]                                     # [N, b, L, K]
        n = sel_NBLK.shape[0]
        hit_NLE = np.zeros((n, l, num_experts + 1), dtype=bool)
        n_idx = np.arange(n)[:, None, None, None]
        l_idx = np.arange(l)[None, None, :, None]
        hit_NLE[n_idx, l_idx, sel_NBLK] = True
        out[b - 1] = hit_NLE[..., :num_experts].sum(axis=2).mean(axis=0)
    return out


def uniform_distinct(num_experts: int, top_k: int, max_batch: int) -> np.ndarray:
    """[B] expected distinct experts of b tokens that each pick K distinct experts uniformly and
    independently: E·(1 − (1 − K/E)^b)."""
    b = np.arange(1, max_batch + 1)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** b)


def _nan_to_none(x):
    """Plain JSON types: arrays and numpy scalars to lists and numbers, NaN to None (recursively)."""
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return _nan_to_none(x.tolist())
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and x != x:
        return None
    return x


def summarize(freq_LE: np.ndarray, rate_LE: np.ndarray, layer_corr_LL: np.ndarray,
              pairs: list[dict[str, Any]], distinct_BL: np.ndarray, top_k: int) -> dict[str, Any]:
    """JSON-ready numbers behind the figures (NaN -> None)."""
    l, e = freq_LE.shape
    uniform = 1.0 / e
    off = layer_corr_LL.copy()
    np.fill_diagonal(off, np.nan)
    b = distinct_BL.shape[0]
    with np.errstate(all="ignore"):
        return _nan_to_none({
            "frequency": {
                "definition": "share of a layer's selections going to each expert (rows sum to 1; uniform 1/E)",
                "uniform": uniform,
                "max_per_layer": freq_LE.max(axis=1),
                "min_per_layer": freq_LE.min(axis=1),
                "max_over_uniform_per_layer": freq_LE.max(axis=1) / uniform,
                "experts_above_uniform_per_layer": (freq_LE > uniform).sum(axis=1),
                "never_selected_per_layer": (freq_LE == 0).sum(axis=1),
                "top_quarter_share_per_layer": np.sort(freq_LE, axis=1)[:, ::-1][:, :max(1, e // 4)].sum(axis=1),
                "rate_row_sums": rate_LE.sum(axis=1),
            },
            "correlation": {
                "layer_summary": layer_corr_LL,
                "adjacent_layers": [float(layer_corr_LL[i, i + 1]) for i in range(l - 1)],
                "mean_cross_layer": float(np.nanmean(off)) if l > 1 else None,
                "top_cross_layer_pairs": pairs,
            },
            "distinct_experts": {
                "per_layer_by_batch": distinct_BL,
                "mean_by_batch": np.nanmean(distinct_BL, axis=1),
                "uniform_independent": uniform_distinct(e, top_k, b),
                "upper_bound": np.minimum(e, top_k * np.arange(1, b + 1)),
            },
        })

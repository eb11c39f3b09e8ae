"""Closed-loop evaluation of budget-targeted routing on a token stream (held-out text).

:func:`heldout_tokens` -- the first N tokens of the held-out split of the training corpus (documents whose
source hashes to a leading ``0``, see :mod:`expertcache.train.data`), joined with EOS, in corpus order.

:func:`stream_eval` -- teacher-forced next-token log-likelihood over consecutive ``context``-token chunks of a
stream (caches carried across chunks: one long stream), under a fixed policy or with a
:class:`~expertcache.routing.controller.MissRateController` attached; returns perplexity, the miss rate and,
with a controller, the per-token miss timeline and strengths.

:func:`fixed_at` -- the perplexity the fixed-strength runs reach at a given miss rate (linear interpolation
between the neighbouring points of their lower convex hull in (miss rate, log ppl)).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from expertcache.routing import RoutingConfig

__all__ = ["heldout_tokens", "stream_eval", "fixed_at"]


def heldout_tokens(tokenizer, n: int, data_dir=None) -> np.ndarray:
    """First ``n`` tokens of the corpus's held-out split (documents joined with EOS), int64."""
    from expertcache.train.data import is_heldout, load_documents, resolve_data_dir

    folder = resolve_data_dir(data_dir)
    out: list[int] = []
    for doc in load_documents(folder):
        if is_heldout(doc["source"]):
            out += tokenizer.encode(doc["text"], add_special_tokens=False) + [tokenizer.eos_token_id]
            if len(out) >= n:
                return np.asarray(out[:n], dtype=np.int64)
    raise ValueError(f"{folder}: held-out split has only {len(out)} tokens, {n} asked")


@torch.no_grad()
def stream_eval(model, tokens: np.ndarray, routing: RoutingConfig, *, capacity, context: int = 256,
                target: float | None = None, controller_kw: dict | None = None, freq_LE=None,
                progress: bool = False) -> dict[str, Any]:
    """Perplexity and miss rate of ``routing`` on ``tokens`` (chunks of ``context`` tokens, caches carried).
    ``target``: attach a miss-rate controller (cache-prior / eras-bias) with ``controller_kw``."""
    from expertcache.models import patch_model
    from expertcache.routing.budget import attach

    n_chunks = len(tokens) // context
    if n_chunks < 1:
        raise ValueError(f"need ≥ {context} tokens, got {len(tokens)}")
    nll, count = 0.0, 0
    with patch_model(model, routing, capacity=capacity, between_sequences="carry", freq_LE=freq_LE) as patch:
        ctl = attach(patch, target, record=True, **(controller_kw or {})) if target is not None else None
        from tqdm import tqdm

        for c in tqdm(range(n_chunks), desc=f"stream {routing.label()}" + (f" target {target}" if target else ""),
                      unit="chunk", disable=not progress):
            ids = torch.from_numpy(tokens[c * context:(c + 1) * context]).reshape(1, -1)
            logits = model(input_ids=ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += context - 1
        stats = patch.stats()
    row = dict(policy=routing.policy, strength=None if target is not None else routing.to_dict(),
               capacity=patch.capacity, tokens=n_chunks * context, ppl=math.exp(nll / count),
               miss_rate=stats.miss_rate, layer_miss_rates=stats.layer_miss_rates(), target=target)
    if ctl is not None:
        k = patch.top_k
        misses_TL = np.array([x.miss_history for x in ctl.layers], dtype=np.int64).T  # [T, L]
        per_tok = misses_TL.sum(1) / (k * misses_TL.shape[1])
        row.update(controller=ctl.state(),
                   running_miss_rate=(np.cumsum(per_tok) / np.arange(1, len(per_tok) + 1)).tolist(),
                   strengths_TL=np.array([x.history for x in ctl.layers]).T.tolist())
    return row


def fixed_at(points: list[tuple[float, float]], miss_rate: float) -> float | None:
    """Perplexity of the fixed-strength runs at ``miss_rate``: the lower convex hull of (miss rate, log ppl)
    interpolated linearly (any mix of two fixed settings reaches the hull); None outside their range."""
    pts = sorted((m, math.log(p)) for m, p in points)
    hull: list[tuple[float, float]] = []
    for p in pts:
        while len(hull) >= 2 and (hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1]) - \
                (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0]) <= 0:
            hull.pop()
        hull.append(p)
    if not hull or not hull[0][0] <= miss_rate <= hull[-1][0]:
        return None
    for (m0, y0), (m1, y1) in zip(hull, hull[1:]):
        if m0 <= miss_rate <= m1:
            w = 0.0 if m1 == m0 else (miss_rate - m0) / (m1 - m0)
            return math.exp(y0 + w * (y1 - y0))
    return math.exp(hull[0][1])


def calibrate_strength(trace, policy: str, capacity, target: float, *, freq_LE=None, iters: int = 8,
                       tokens: int | None = None) -> float:
    """The fixed strength (λ or β) whose open-loop miss rate on ``trace`` (the simulator, LRU, caches carried
    between its sequences) is ``target``: bisection on log strength over the controller's default range.
    The controller starts there (``ControllerConfig(s0=...)``) and corrects online what the open loop and the
    other text get wrong. ``tokens``: simulate only the first tokens of the trace."""
    from expertcache.routing.config import STRENGTH
    from expertcache.routing.controller import DEFAULT_RANGE
    from expertcache.sim import simulate

    if tokens is not None:
        trace = trace.head(tokens)
    lo, hi, _ = DEFAULT_RANGE[policy]
    a, b = math.log(lo), math.log(hi)

    def rate(log_s: float) -> float:
        rc = RoutingConfig(policy, **{STRENGTH[policy]: float(math.exp(log_s))})
        return simulate(trace, rc, capacity, between_sequences="carry", freq_LE=freq_LE).miss_rate

    if rate(a) <= target:
        return lo
    if rate(b) >= target:
        return hi
    for _ in range(iters):
        mid = 0.5 * (a + b)
        if rate(mid) > target:
            a = mid
        else:
            b = mid
    return float(math.exp(0.5 * (a + b)))

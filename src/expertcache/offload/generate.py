"""Decoding over a forward function: greedy or sampled tokens, teacher forcing, stop tokens, and the timings and
statistics of the decode steps alone.

:func:`generate` knows nothing of the model, the caches or the captured step: it is handed ``start``, which
runs the prefill and returns (the last position's logits [B, V], ``step``: one token [B, 1] -> the next logits
[B, V], ``compile_s()``: seconds the step's graph took to compile after the prefill, 0 when none) and ``stats()``,
the runtime's counters (:meth:`~expertcache.offload.runtime.OffloadedModel.stats`). gpt-fast's shape: a prefill,
then one small decode step per token, each a natural timing boundary.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from expertcache.device import to_host

__all__ = ["generate", "DECODE_STATS"]

#: the counters of ``stats()`` reported for the decode steps only (differences over the decode)
DECODE_STATS = ("accesses", "hits", "misses", "low_computes", "bytes_read", "expert_loads", "io_seconds",
                "io_wait_seconds", "compute_seconds")


def generate(start: Callable[[], tuple], max_new_tokens: int, *, stats: Callable[[], dict], rows: int, source: Path,
             temperature: float = 0.0, seed: int = 0, on_token: Callable[[torch.Tensor], None] | None = None,
             stop: int | None = None, forced_BN: torch.Tensor | None = None) -> dict:
    """Greedy (``temperature=0``) or sampled decoding of ``rows`` rows (see the module docstring for ``start``
    and ``stats``). Returns ``tokens`` [B, n], ``prefill_s``, ``decode_s`` (time of the decode steps only),
    ``decode_tokens`` (forward calls after the prefill), ``decode_stats`` (:data:`DECODE_STATS` of those calls
    only, and their hit rate) and ``compile_s`` (counted in neither prefill nor decode). ``on_token`` sees each
    new [B, 1] token as soon as it is chosen; ``forced_BN`` feeds those tokens instead of choosing (the
    benchmark's teacher-forced mode). Non-finite logits raise ValueError naming the decode step and ``source``
    (the model's weights)."""
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    logits_BV, step, compile_s = start()
    t1 = time.perf_counter()
    s0 = stats()
    toks = []
    decode_s = 0.0
    for i in range(max_new_tokens):
        # one device -> host transfer per token: the greedy choice with the finiteness check packed beside
        # it, or (sampling with the host generator) the logits
        if forced_BN is not None:
            finite = bool(to_host(torch.isfinite(logits_BV).all()))
        elif temperature > 0:
            host_BV = to_host(logits_BV.float())
            finite = bool(torch.isfinite(host_BV).all())
        else:
            pick_B1 = torch.cat([logits_BV.float().argmax(dim=-1, keepdim=True),
                                 torch.isfinite(logits_BV).all().long().expand(logits_BV.shape[0], 1)], dim=1)
            pick_B1 = to_host(pick_B1)
            finite = bool(pick_B1[0, 1])
        if not finite:
            raise ValueError(f"non-finite logits (NaN/inf) at decode step {i}: the weights or activations of "
                             f"{source} are not finite")
        if forced_BN is not None:  # teacher-forced continuation (benchmarks: same tokens for every policy)
            nxt_B1 = forced_BN[:, i:i + 1]
        elif temperature > 0:
            probs = torch.softmax(host_BV / temperature, dim=-1)
            nxt_B1 = torch.multinomial(probs, 1, generator=g)
        else:
            nxt_B1 = pick_B1[:, :1]
        toks.append(nxt_B1)
        if on_token is not None:
            on_token(nxt_B1)
        if (stop is not None and bool((nxt_B1 == stop).all())) or i == max_new_tokens - 1:
            break
        t = time.perf_counter()
        logits_BV = step(nxt_B1)
        decode_s += time.perf_counter() - t
    tokens = torch.cat(toks, dim=1) if toks else torch.zeros(rows, 0, dtype=torch.long)
    s1 = stats()
    d = {k: s1[k] - s0[k] for k in DECODE_STATS}
    d["hit_rate"] = d["hits"] / d["accesses"] if d["accesses"] else 0.0
    c = compile_s()  # the step's graph, made after the prefill
    return dict(tokens=tokens, prefill_s=t1 - t0 - c, decode_s=decode_s, decode_tokens=max(0, len(toks) - 1),
                decode_stats=d, compile_s=c)

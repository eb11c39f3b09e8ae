"""Next-layer speculative prefetch: *what* to read ahead (the guess) and how good the guesses were.

While layer ℓ computes, layer ℓ+1's experts are guessed by applying layer ℓ+1's own router to the hidden
state entering layer ℓ's experts (the pre-gating idea of MoE-Infinity / Pre-gated MoE: the residual stream
changes little from one layer to the next); with a cache-aware routing policy the policy is applied to the
guess too, against layer ℓ+1's live residency, with its running state (Cache-Prior's Δavg) left untouched.
The runtime reads the non-resident guesses into spare slots (:meth:`OffloadedModel._guess_next`); a
spare is used only when its expert turns out to be a miss, so a wrong guess costs bandwidth, never
correctness.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

__all__ = ["PrefetchStats", "guess_next_layer"]


@dataclass
class PrefetchStats:
    """Next-layer guesses: ``guessed`` ids, ``correct`` (guessed and requested by the step), ``requested``
    ids of the guessed steps; ``issued`` reads, ``used`` (a demand miss served from a prefetched slot),
    ``bytes`` read by prefetches, ``used_bytes`` of those that served a miss."""

    guessed: int = 0
    correct: int = 0
    requested: int = 0
    issued: int = 0
    used: int = 0
    bytes: int = 0
    used_bytes: int = 0

    def to_dict(self) -> dict:
        return dict(guessed=self.guessed, correct=self.correct, requested=self.requested, issued=self.issued,
                    used=self.used, bytes=self.bytes, used_bytes=self.used_bytes,
                    precision=self.correct / self.guessed if self.guessed else None,
                    recall=self.correct / self.requested if self.requested else None,
                    unused_bytes=self.bytes - self.used_bytes)


@torch.inference_mode()
def guess_next_layer(rt, index: int, x_TD: torch.Tensor) -> list[int]:
    """Distinct expert ids (routing order) that MoE layer ``index`` of runtime ``rt`` would select for
    ``x_TD`` [T, D] -- the hidden state entering the previous MoE layer's experts. Pure: no cache, router or
    policy state changes."""
    z_TE, w0_TK, ids_TK = rt._stock_routers[index](x_TD)
    if rt.routing.policy != "original":
        saved = copy.deepcopy(rt.router.deltas.get(index))
        try:
            _, ids_TK = rt._route(rt.states[index].moe, z_TE, w0_TK, ids_TK)
        finally:
            if saved is None:
                rt.router.deltas.pop(index, None)
            else:
                rt.router.deltas[index] = saved
    return [e for e in dict.fromkeys(ids_TK.reshape(-1).tolist()) if e >= 0]

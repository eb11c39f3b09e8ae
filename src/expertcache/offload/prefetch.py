"""Next-layer speculative prefetch: *what* to read ahead (the guess) and how good the guesses were.

While layer ℓ computes, layer ℓ+1's experts are guessed by applying layer ℓ+1's own router to the hidden
state entering layer ℓ's experts (the pre-gating idea of MoE-Infinity / Pre-gated MoE: the residual stream
changes little from one layer to the next); with a cache-aware routing policy the policy is applied to the
guess too, against layer ℓ+1's live residency, with its running state (Cache-Prior's Δavg) left untouched.
The runtime reads the non-resident guesses into spare slots (:meth:`~expertcache.offload.step.CacheSteps.guess_next`); a
spare is used only when its expert turns out to be a miss, so a wrong guess costs bandwidth, never
correctness.

The first MoE layer has no earlier MoE layer to guess from: its guess is made before its decoder layer's
attention runs, from the hidden state entering that decoder layer (the token's embedding when the first
decoder layer is MoE) through that layer's own ``post_attention_layernorm`` and router
(:func:`first_layer_input`), so its reads overlap its attention instead of starting after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PrefetchStats", "guess_next_layer", "first_layer_input"]


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
    per_layer: dict = field(default_factory=dict)  # MoE layer index -> [guessed, correct, requested]

    def score(self, index: int, guess: list[int], order: list[int]) -> None:
        """Count the guess made for layer ``index`` against the ids its step requested (``order``)."""
        g = set(guess)
        c = len(g.intersection(order))
        self.guessed += len(g)
        self.correct += c
        self.requested += len(order)
        row = self.per_layer.setdefault(index, [0, 0, 0])
        row[0] += len(g)
        row[1] += c
        row[2] += len(order)

    def to_dict(self) -> dict:
        per = {i: dict(guessed=g, correct=c, requested=r, precision=c / g if g else None,
                       recall=c / r if r else None) for i, (g, c, r) in sorted(self.per_layer.items())}
        return dict(guessed=self.guessed, correct=self.correct, requested=self.requested, issued=self.issued,
                    used=self.used, bytes=self.bytes, used_bytes=self.used_bytes,
                    precision=self.correct / self.guessed if self.guessed else None,
                    recall=self.correct / self.requested if self.requested else None,
                    unused_bytes=self.bytes - self.used_bytes, per_layer=per)


def first_layer_input(decoder_layer: torch.nn.Module, hidden_BSD: torch.Tensor) -> torch.Tensor:
    """[T, D]: the guess input of the first MoE layer -- the hidden state entering its decoder layer (before
    attention), normalised by that layer's ``post_attention_layernorm`` as the MoE block's input is."""
    x_TD = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    norm = getattr(decoder_layer, "post_attention_layernorm", None)
    return norm(x_TD) if norm is not None else x_TD


@torch.inference_mode()
def guess_next_layer(rt, index: int, x_TD: torch.Tensor) -> list[int]:
    """Distinct expert ids (routing order) that MoE layer ``index`` of runtime ``rt`` would select for
    ``x_TD`` [T, D] -- the hidden state entering the previous MoE layer's experts. Pure: no cache, router or
    policy state changes. On a device the ids are read through ``rt.host_copy``: the copy the previous
    layer's router call fetched with its own (no transfer of their own)."""
    z_TE, w0_TK, ids_TK = rt.stock_route(index, x_TD)
    if rt.routing.policy != "original":
        _, ids_TK = rt.route(rt.layers[index], z_TE, w0_TK, ids_TK, commit=False)
    return [e for e in dict.fromkeys(rt.host_copy(ids_TK).reshape(-1).tolist()) if e >= 0]

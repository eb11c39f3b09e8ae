"""Computing with one expert whose bytes sit in a slot: typed views (no copy, no dtype conversion when the
storage dtype is the compute dtype) and the family's expert MLP, written exactly as transformers writes it
so that offloaded logits equal the in-memory model's bit for bit.

- ``linear`` layout (OLMoE, Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, PhiMoE): ``gate, up = linear(x, gate_up
  [2F, D]).chunk(2)``; ``linear(act(gate) * up, down [D, F])``;
- ``gpt_oss``: ``x @ gate_up [D, 2F] + b``, gate/up interleaved, clamped SwiGLU with α and limit,
  ``@ down [F, D] + b``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from expertcache.offload.checkpoint import ExpertParts
from expertcache.offload.quant import QuantLayout, unpack_expert
from expertcache.offload.store import Placement

__all__ = ["expert_views", "expert_mlp", "OffloadedExperts"]


def expert_views(blob_u8: torch.Tensor, parts: ExpertParts, placement: Placement, dtype: torch.dtype,
                 quant: QuantLayout | None = None) -> tuple[torch.Tensor, ...]:
    """The expert's tensors (``ExpertParts.tensors()`` order) as views of its slot ``blob_u8``, in ``dtype``
    (a view when the storage dtype is ``dtype``; quantised experts are dequantised)."""
    if quant is not None:
        at = placement.slot_offset(parts, 0)
        return unpack_expert(blob_u8[at:at + parts.nbytes], quant, dtype)
    esize = torch.empty((), dtype=parts.dtype).element_size()
    out = []
    for off, shape in parts.tensors().values():
        at = placement.slot_offset(parts, off * esize)
        t = blob_u8[at:at + math.prod(shape) * esize].view(parts.dtype).view(shape)
        out.append(t if t.dtype == dtype else t.to(dtype))
    return tuple(out)


def expert_mlp(layout: str, experts_module: nn.Module) -> Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]:
    """``f(x_TD, weights) -> h_TD``: the family's expert MLP, taking its constants (activation, GPT-OSS α and
    limit) from the model's own (replaced) experts module."""
    if layout == "gpt_oss":
        alpha, limit = experts_module.alpha, experts_module.limit

        def gpt_oss(x_TD, w):
            gate_up, gate_up_bias, down, down_bias = w
            gu_TF2 = x_TD @ gate_up + gate_up_bias
            gate, up = gu_TF2[..., ::2], gu_TF2[..., 1::2]
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            return ((up + 1) * glu) @ down + down_bias
        return gpt_oss
    act = experts_module.act_fn

    def linear(x_TD, w):
        gate_up, down = w
        gate, up = F.linear(x_TD, gate_up).chunk(2, dim=-1)
        return F.linear(act(gate) * up, down)
    return linear


class OffloadedExperts(nn.Module):
    """Drop-in for a transformers experts module: ``forward(hidden_TD, ids_TK, weights_TK)``, weights
    served by the runtime. Holds no parameters."""

    def __init__(self, runtime, index: int) -> None:
        super().__init__()
        self._runtime = [runtime]  # a list: not registered as a submodule
        self.index = index

    def forward(self, hidden_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self._runtime[0]._serve(self.index, hidden_TD, ids_TK, weights_TK)

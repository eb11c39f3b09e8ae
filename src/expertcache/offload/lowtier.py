"""The resident low-precision tier (``--resident-quant int4``, issue 37): every expert's int4 copy, packed for
the fused kernels (:mod:`~expertcache.offload.quant`), held in memory beside the full-precision slot cache and
the disk / host tier, so a miss can be computed now at 4 bits instead of waited for.

Bytes only: which misses are computed here is the rule of :mod:`expertcache.routing.precision`, applied by the
step (:mod:`~expertcache.offload.step`). The copies come from the same sidecar ``--quant int4`` reads (written
once, streaming, into the cache folder), one ``[N, blob bytes]`` uint8 tensor per MoE layer (a
:class:`~expertcache.offload.store.HostTier` of it; moved to the device on a GPU), and the kernel tensors of
each expert are views of its row made once. The plan counts ``L · N · blob bytes`` (``low_tier_bytes``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from expertcache.offload.quant import QuantLayout, quant_mlp
from expertcache.offload.store import HostTier, QuantSource

__all__ = ["LOW_MODES", "LowPrecisionTier", "low_tier_bytes"]

#: the precisions a resident low-precision tier can hold
LOW_MODES = ("int4",)


def low_tier_bytes(layout: QuantLayout, num_layers: int, num_experts: int) -> int:
    """Bytes of every expert's copy in ``layout`` (the plan's term, known before anything is loaded)."""
    return num_layers * num_experts * layout.nbytes


class LowPrecisionTier:
    """Every expert of ``layer_ids`` from ``source`` in memory; :meth:`compute` runs one expert's MLP on its copy
    with the fused kernels (the same function as ``--quant int4``'s slots, so an expert computed here gives
    the all-int4 model's output). ``acts``: each MoE layer's activation, in MoE-layer order."""

    def __init__(self, source: QuantSource, layer_ids: Sequence[int], num_experts: int, device: torch.device,
                 acts: Sequence[Callable]) -> None:
        self.layout = source.quant
        self.path = source.path
        host = HostTier(source, list(layer_ids), num_experts)
        rows = [host.rows[i] for i in layer_ids]
        if device.type != "cpu":  # pragma: no cover - GPU only
            rows = [r.to(device) for r in rows]
        self.rows = rows
        self.nbytes = host.nbytes
        self._views = [[self.layout.views(r[e]) for e in range(num_experts)] for r in rows]
        self._mlps = [quant_mlp(self.layout, act) for act in acts]

    def compute(self, index: int, e: int, x_TD: torch.Tensor) -> torch.Tensor:
        """[T, D]: expert ``e`` of MoE layer ``index`` on ``x_TD`` from its low-precision copy."""
        return self._mlps[index](x_TD, self._views[index][e])

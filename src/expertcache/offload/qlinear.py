"""The non-expert weights quantised (``--quant-dense``): attention projections and ``lm_head`` through the fused
kernels of :mod:`expertcache.offload.quant`, the token embedding as int8 rows.

- :class:`QuantLinear` replaces an ``nn.Linear``: its weight packed once (int8 per output channel, or int4 with
  groups of :data:`DENSE_GROUP` along K, K zero-padded where needed), every call one :func:`qmm`;
- :class:`QuantEmbedding` replaces an ``nn.Embedding``: int8 codes [V, D] and a scale per row (a lookup reads
  D + 2 bytes per token; no kernel is needed);
- which modules: :func:`dense_targets` (the ``nn.Linear`` modules of every decoder layer's ``self_attn`` and
  ``lm_head``; the MoE router, shared experts and norms stay in the compute dtype: routing decisions are
  sensitive, the rest is small). With tied embeddings the quantised ``lm_head`` and the int8 embedding are two
  tensors (the bf16 one is dropped).

The packed tensors are non-persistent buffers, so the runtime's memory plan (which sums the model's parameters
and buffers) counts them; :func:`dense_bytes` gives the same count for a model not yet quantised (a meta-device
skeleton is enough), for a plan made before loading.
"""

from __future__ import annotations

import torch
from torch import nn

from expertcache.offload.quant import QuantMatrix, kernel_for, pack_matrix, qmm

__all__ = ["DENSE_MODES", "DENSE_GROUP", "QuantLinear", "QuantEmbedding", "dense_targets", "quantize_dense",
           "dense_bytes"]

DENSE_MODES = ("none", "int8", "int4")
#: the int4 group size of the dense weights (K padded to it where needed)
DENSE_GROUP = 32


def _matrix(mode: str, n: int, k: int, dtype: torch.dtype, device) -> QuantMatrix:
    return QuantMatrix(mode, kernel_for(mode, device), n, k, DENSE_GROUP, dtype)


class QuantLinear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` packed for the fused kernel (``x`` of any leading shape)."""

    def __init__(self, linear: nn.Linear, mode: str) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.qm = _matrix(mode, w.shape[0], w.shape[1], w.dtype, w.device)
        packed, scales = pack_matrix(w.to("cpu", torch.float32), self.qm)
        self.register_buffer("qweight", packed.to(w.device), persistent=False)
        self.register_buffer("scales", scales.to(w.device), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = qmm(x.reshape(-1, x.shape[-1]), self.qweight, self.scales, self.qm)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qm.mode} ({self.qm.kernel})"


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` as int8 rows: ``E[i] = q[i] · s[i]`` (``s = max|row| / 127`` in the compute dtype)."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        w = emb.weight.detach()
        s = (w.float().abs().amax(dim=1) / 127).to(w.dtype).float()
        s = torch.where(s > 0, s, torch.ones_like(s))
        self.register_buffer("codes", torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8),
                             persistent=False)
        self.register_buffer("scales", s.to(w.dtype), persistent=False)
        self.padding_idx = emb.padding_idx
        self.num_embeddings, self.embedding_dim = w.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codes[ids].to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)


def dense_targets(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module of what ``--quant-dense`` replaces: every ``nn.Linear`` under a ``self_attn``, ``lm_head``,
    and the input embedding."""
    out = {name: mod for name, mod in model.named_modules()
           if type(mod) is nn.Linear and (".self_attn." in f".{name}." or name == "lm_head")}
    emb = model.get_input_embeddings()
    for name, mod in model.named_modules():
        if mod is emb:
            out[name] = mod
    return out


def quantize_dense(model: nn.Module, mode: str | None) -> int:
    """Replace :func:`dense_targets` of ``model`` (weights loaded) with :class:`QuantLinear` /
    :class:`QuantEmbedding`, one module at a time (the peak is one bf16 matrix more). Returns how many."""
    if mode in (None, "none"):
        return 0
    if mode not in DENSE_MODES:
        raise ValueError(f"--quant-dense must be one of {', '.join(DENSE_MODES)}, got {mode!r}")
    targets = dense_targets(model)
    for name, mod in targets.items():
        new = QuantEmbedding(mod) if isinstance(mod, nn.Embedding) else QuantLinear(mod, mode)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return len(targets)


def dense_bytes(model: nn.Module, mode: str | None, *, skip_experts: bool = True) -> int:
    """Bytes of ``model``'s non-expert weights (parameters and buffers, each storage once; those under an
    ``.experts.`` module skipped) once :func:`quantize_dense` has run with ``mode`` -- the model may be a
    meta-device skeleton, nothing is allocated."""
    targets = {} if mode in (None, "none") else dense_targets(model)
    replaced = {id(p) for m in targets.values() for p in m.parameters(recurse=False) if p is getattr(m, "weight", None)}
    seen, total = set(), 0
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        if (skip_experts and ".experts." in f".{name}") or id(t) in replaced or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    for mod in targets.values():
        w = mod.weight
        if isinstance(mod, nn.Embedding):
            total += w.shape[0] * w.shape[1] + w.shape[0] * w.element_size()
        else:
            total += sum(_matrix(mode, w.shape[0], w.shape[1], w.dtype, "cpu").part_bytes())
    return total

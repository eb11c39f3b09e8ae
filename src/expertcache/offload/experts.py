"""Computing with one expert whose bytes sit in a slot: typed views (no copy, no dtype conversion when the
storage dtype is the compute dtype) and the family's expert MLP, written exactly as transformers writes it
so that offloaded logits equal the in-memory model's bit for bit.

- ``linear`` layout (OLMoE, Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, PhiMoE): ``gate, up = linear(x, gate_up
  [2F, D]).chunk(2)``; ``linear(act(gate) * up, down [D, F])``;
- ``interleaved`` layout (GPT-OSS): ``x @ gate_up [D, 2F] + b``, gate/up interleaved, clamped SwiGLU with α and
  limit, ``@ down [F, D] + b``.

One token (decoding) is a matrix-vector product: ``torch.mv(W, x)`` instead of ``F.linear(x[None], W)``.
The same values (bit for bit on this VM: oneDNN's bf16 kernel with fp32 accumulation either way, MKL for
fp32; other CPUs may differ in the last bit), but for bf16 oneDNN treats a one-row ``linear`` as a
[1, K] × [K, N] product against the transposed weight and
streams it at ~10.6 GB/s on this VM's AMX Xeon, and ``mv`` (the weight as the source) at ~13.9 GB/s, the
single-core memory bandwidth (1.3× per expert; fp32: equal). :func:`use_matvec` applies the same rule to
the model's other ``nn.Linear`` modules (attention projections, ``lm_head``), which read as many bytes per
token as the experts in an all-resident model.

Several rows in bfloat16/float16 on a CPU are padded with zero rows to a bucket (:func:`row_bucket`: a power
of two up to 128, then a multiple of 128) and the result sliced back. oneDNN builds and keeps a kernel for
every row count M it sees: about 0.66 MiB of RSS per new M per weight shape, held for the life of the process
(a [208, 144] bf16 ``linear`` over M = 1..1024: +680 MiB; float32 goes to MKL: +0.8 MiB), so a server whose
batches and prompts keep producing new M grew in steps for as long as it ran. Buckets bound the row counts
to a few dozen. The rows are computed independently of M (the real rows' values are the same bit for bit
padded or not: checked for M = 1..256 here and by ``tests/test_row_buckets.py``); the padding costs at
most the rows added (< 2×, and nothing where the call's fixed cost dominates, as it does for expert rows).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

# the byte layout's views and in-graph product (expert_views re-exported: where the family's MLP reads its weights)
from expertcache.offload.layout import expert_views, inline_product

__all__ = ["expert_views", "expert_mlp", "OffloadedExperts", "matvec_linear", "use_matvec", "row_bucket",
           "rows_bucketed", "bucket_rows"]

#: dtypes whose multi-row products on a CPU go to oneDNN's per-shape kernels (module docstring)
_BUCKETED = (torch.bfloat16, torch.float16)


def row_bucket(m: int) -> int:
    """The row count ``m`` rows are padded to: the next power of two up to 128, then the next multiple of 128."""
    if m <= 128:
        return 1 << (m - 1).bit_length() if m > 1 else m
    return -(-m // 128) * 128


def rows_bucketed(x: torch.Tensor) -> bool:
    """Whether a multi-row product with ``x`` is padded to :func:`row_bucket` rows (bf16/fp16 on a CPU)."""
    return x.dtype in _BUCKETED and x.device.type == "cpu"


def bucket_rows(x_MD: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(``x_MD`` with zero rows appended up to :func:`row_bucket` rows where :func:`rows_bucketed`, else
    ``x_MD``; its own row count M). A product of the result is sliced back with ``[:M]``."""
    m = x_MD.shape[0]
    if m > 1 and rows_bucketed(x_MD):
        b = row_bucket(m)
        if b != m:
            return torch.cat([x_MD, x_MD.new_zeros(b - m, x_MD.shape[1])]), m
    return x_MD, m


def expert_mlp(layout: str, experts_module: nn.Module) -> Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]:
    """``f(x_TD, weights) -> h_TD``: the family's expert MLP, taking its constants (activation, GPT-OSS α and
    limit) from the model's own (replaced) experts module."""
    if layout == "interleaved":
        alpha, limit = experts_module.alpha, experts_module.limit

        def interleaved(x_TD, w):
            gate_up, gate_up_bias, down, down_bias = w
            x_TD, m = bucket_rows(x_TD)
            gu_TF2 = x_TD @ gate_up + gate_up_bias
            gate, up = gu_TF2[..., ::2], gu_TF2[..., 1::2]
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            out = ((up + 1) * glu) @ down + down_bias
            return out if out.shape[0] == m else out[:m]
        return interleaved
    act = experts_module.act_fn

    def linear(x_TD, w):
        gate_up, down = w
        if x_TD.shape[0] == 1:  # one token: two matrix-vector products (module docstring)
            gate, up = torch.mv(gate_up, x_TD[0]).chunk(2)
            return torch.mv(down, act(gate) * up)[None]
        x_TD, m = bucket_rows(x_TD)
        gate, up = F.linear(x_TD, gate_up).chunk(2, dim=-1)
        out = F.linear(act(gate) * up, down)
        return out if out.shape[0] == m else out[:m]
    linear.act = act  # the one-token step batches the activation over its experts (step.py CacheSteps._serve_one)
    return linear


#: inside a torch.compile graph a one-row product with a weight of at least this many elements stays aten's
#: ``mv`` (the opaque ``expertcache::matvec``): inductor's own code for it is slower on a CPU at real shapes
#: (OLMoE's 50304 x 2048 lm_head: 20 ms against 12 ms, bf16, 2 threads), while small ones fuse with their neighbours
OPAQUE_MATVEC_ELEMENTS = 1 << 20

_LIB = torch.library.Library("expertcache", "FRAGMENT")
_LIB.define("matvec(Tensor weight, Tensor x, Tensor? bias) -> Tensor")
_LIB.impl("matvec", lambda w, x, b: torch.mv(w, x) if b is None else torch.addmv(b, w, x), "CompositeExplicitAutograd")
torch.library.register_fake("expertcache::matvec", lambda w, x, b: x.new_empty(w.shape[0]), lib=_LIB)


def matvec_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``torch.mv``/``torch.addmv`` when ``x`` holds one row (traced by
    torch.compile: :data:`OPAQUE_MATVEC_ELEMENTS`)."""
    if x.numel() != x.shape[-1] or x.dtype != weight.dtype or weight.dim() != 2:
        if x.dim() >= 2 and x.numel() and rows_bucketed(x):  # several rows: padded to a bucket (module docstring)
            x_MD, m = bucket_rows(x.reshape(-1, x.shape[-1]))
            if x_MD.shape[0] != m:
                return F.linear(x_MD, weight, bias)[:m].reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)
    v = x.reshape(-1)
    if weight.numel() >= OPAQUE_MATVEC_ELEMENTS and torch.compiler.is_compiling():
        y = torch.ops.expertcache.matvec(weight, v, bias)
    else:
        y = torch.mv(weight, v) if bias is None else torch.addmv(bias, weight, v)
    return y.view(*x.shape[:-1], weight.shape[0])


def use_matvec(model: nn.Module) -> None:
    """Route every ``nn.Linear`` of ``model`` through :func:`matvec_linear` (one-row inputs become
    matrix-vector products; others unchanged)."""
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.forward = _MatvecForward(mod)


class _MatvecForward:
    __slots__ = ("mod",)

    def __init__(self, mod: nn.Linear) -> None:
        self.mod = mod

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return matvec_linear(x, self.mod.weight, self.mod.bias)


class OffloadedExperts(nn.Module):
    """Drop-in for a transformers experts module: ``forward(hidden_TD, ids_TK, weights_TK)``, weights
    served by the runtime. Holds no parameters."""

    def __init__(self, runtime, index: int) -> None:
        super().__init__()
        self._runtime = [runtime]  # a list: not registered as a submodule
        self.index = index

    def bind(self, runtime) -> None:
        """Serve from ``runtime`` (the runtime is built after the model it replaces the experts of)."""
        self._runtime = [runtime]

    def forward(self, hidden_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        rt = self._runtime[0]
        if rt.capture.capturing and torch.compiler.is_compiling():  # traced by the captured decode step (models/captured.py)
            graph = rt.graph_products(self.index)
            if graph is None:
                return torch.ops.expertcache.experts(hidden_TD, ids_TK, weights_TK, self.index)
            slot_K, rest_TD = torch.ops.expertcache.cache_step(hidden_TD, ids_TK, weights_TK, self.index)
            return inline_product(graph[0], hidden_TD, slot_K, weights_TK, graph[1]) + rest_TD
        return rt._serve(self.index, hidden_TD, ids_TK, weights_TK)

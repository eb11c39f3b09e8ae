"""The non-expert weights quantised (``--quant-dense``): attention projections and ``lm_head`` through the fused
kernels of :mod:`expertcache.offload.quant`, the token embedding as int8 rows.

- :class:`QuantLinear` replaces an ``nn.Linear``: its weight packed once (int8 per output channel, or int4 with
  groups of :data:`DENSE_GROUP` along K, K zero-padded where needed), every call one :func:`qmm` (int4: q4x8's
  layout and kernel where the int4 experts would run on it, :func:`~expertcache.offload.quant.dense_int4_kernel`);
- :class:`QuantEmbedding` replaces an ``nn.Embedding``: int8 codes [V, D] and a scale per row (a lookup reads
  D + 2 bytes per token; no kernel is needed), or int4 codes (two a byte) with a scale and a zero per group of
  :data:`DENSE_GROUP` (``int4-head8``);
- ``--quant-dense int4-head8``: per-tensor precision as llama.cpp's Q4_K_M chooses it (its ``output`` at 6 bits):
  attention and the embedding int4 (int8 rows where D is not a multiple of 64), ``lm_head`` int8, weight-only
  (:func:`target_modes`);
- which modules: :func:`dense_targets` (the ``nn.Linear`` modules of every decoder layer's ``self_attn`` and
  ``lm_head``; the MoE router, shared experts and norms stay in the compute dtype: routing decisions are
  sensitive, the rest is small). With tied embeddings the quantised ``lm_head`` and the int8 embedding are two
  tensors (the bf16 one is dropped).

Loading (:func:`quantize_dense_skeleton`, then :func:`expertcache.offload.loader.load_non_expert`) packs each
weight straight from the checkpoint a block of :data:`~expertcache.offload.quant.PACK_ROWS` rows at a time, so
no full-precision copy of a quantised matrix is ever held: the loading peak is the quantised model plus one
block. The packed tensors are non-persistent buffers, so the runtime's memory plan (which sums the model's parameters
and buffers) counts them; :func:`dense_bytes` gives the same count for a model not yet quantised (a meta-device
skeleton is enough), for a plan made before loading.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from expertcache.offload import q8x8
from expertcache.offload.diskembed import DiskEmbedding
from expertcache.offload.fbgemm import fbgemm_linear, fbgemm_prepack
from expertcache.offload.quant import (PACK_ROWS, QuantMatrix, dense_int4_kernel, dense_int8_kernel, dense_layout_kernel,
                                       fbgemm_vnni, pack_matrix_into, qmm, quantize_codes)

__all__ = ["DENSE_MODES", "DENSE_GROUP", "DENSE_INT8_KERNELS", "DENSE_INT8_KERNEL_VAR", "int8_kernel", "QuantLinear", "QuantEmbedding", "dense_targets", "quantize_dense",
           "quantize_dense_skeleton", "dense_bytes", "fbgemm_shapes", "dense_kernel_note"]

DENSE_MODES = ("none", "int8", "int4", "int4-head8")
#: the int4 group size of the dense weights (K padded to it where needed)
DENSE_GROUP = 32


def target_modes(mode: str) -> tuple[str, str, str]:
    """(attention, ``lm_head``, embedding) precision of a ``--quant-dense`` mode."""
    return {"int8": ("int8", "int8", "int8"), "int4": ("int4", "int4", "int8"),
            "int4-head8": ("int4", "int8", "int4")}[mode]


def _target_mode(name: str, mod: nn.Module, mode: str) -> str:
    """The precision of one target; an int4 embedding needs D a multiple of 2 × DENSE_GROUP, else int8 rows (the
    shipped models' D = 144)."""
    attn, head, emb = target_modes(mode)
    if isinstance(mod, nn.Embedding):
        return emb if emb == "int8" or mod.weight.shape[1] % (2 * DENSE_GROUP) == 0 else "int8"
    return head if name == "lm_head" else attn


def _weight_only(name: str, mode: str) -> bool:
    """``int4-head8``'s int8 ``lm_head`` runs weight-only (``_weight_int8pack_mm``) or on q8x8 (:func:`int8_kernel`),
    not on FBGEMM: FBGEMM's activation quantisation (7-bit on AVX2) there cost more KL than Q4_K_M's whole margin
    (BENCHMARKS.md)."""
    return mode == "int4-head8" and name == "lm_head"


#: the int8 dense products on a CPU (:func:`int8_kernel`)
DENSE_INT8_KERNELS = ("fbgemm", "int8pack", "q8x8")
#: forces :func:`int8_kernel` on the CPU (benchmarks, tests): one of :data:`DENSE_INT8_KERNELS`
DENSE_INT8_KERNEL_VAR = "EXPERTCACHE_DENSE_INT8_KERNEL"


def int8_kernel(device: torch.device | str = "cpu", *, compiled: bool = False, weight_only: bool = False) -> str:
    """The product of an int8 dense matrix on ``device``. A GPU or ``compiled`` (``--compile``): ``int8pack``. On
    a CPU, ``$EXPERTCACHE_DENSE_INT8_KERNEL`` (one of :data:`DENSE_INT8_KERNELS`; ValueError naming it for another
    value, for q8x8 without numba, for fbgemm where torch has none) wins; else q8x8 where FBGEMM has no VNNI and
    numba and AVX2 are there (activations 8-bit per 32 values, as llama.cpp quantises every product's), for the int8
    dense part and ``int4-head8``'s weight-only ``lm_head`` alike: in a decode step it is the faster one (AVX2-only
    AMD EPYC, one thread, 8-layer OLMoE shape, interleaved: attention projections 21-23 ms a token against FBGEMM's
    26-31 -- FBGEMM's own product is quicker on cold weights, 0.42 against 0.62 ms on [2048, 2048], but its row
    scaling and casts around it are not; ``lm_head`` 11.6-12.1 against 14.0-15.7 ms, and 11.1-13.4 against
    ``_weight_int8pack_mm``'s 27.2-27.4), keeps more quality (the q4 preset's mean KL on granular's held-out split
    0.00533 against 0.00862 with FBGEMM's 7-bit activations) and needs no packing at start-up. Elsewhere FBGEMM
    (:func:`~expertcache.offload.quant.dense_int8_kernel`; with VNNI its 8-bit products) for the dense part and
    ``_weight_int8pack_mm`` for a weight-only head."""
    import os

    forced = os.environ.get(DENSE_INT8_KERNEL_VAR, "").strip() or None
    if forced is not None and forced not in DENSE_INT8_KERNELS:
        raise ValueError(f"{DENSE_INT8_KERNEL_VAR} must be one of {', '.join(DENSE_INT8_KERNELS)}, got {forced!r}")
    if torch.device(device).type != "cpu" or compiled:
        return "int8pack"
    if forced == q8x8.KERNEL and not q8x8.available():
        raise ValueError(f"{DENSE_INT8_KERNEL_VAR}=q8x8 needs numba (not installed, or EXPERTCACHE_NO_NUMBA is set)")
    if forced == "fbgemm" and dense_int8_kernel(device) != "fbgemm":
        raise ValueError(f"{DENSE_INT8_KERNEL_VAR}=fbgemm: this torch has no FBGEMM engine")
    if forced:
        return forced
    if q8x8.available() and q8x8.use_avx2() and not fbgemm_vnni():
        return q8x8.KERNEL
    return "int8pack" if weight_only else dense_int8_kernel(device)


def _matrix(mode: str, n: int, k: int, dtype: torch.dtype, device, optimize: str = "minmax", *,
            compiled: bool = False) -> QuantMatrix:
    """The layout of one dense matrix: int4 in q4x8's where :func:`~expertcache.offload.quant.dense_int4_kernel`
    runs it (the same bytes as torch's int4 layout: :func:`dense_bytes` is unchanged), else the fused kernel's."""
    return QuantMatrix(mode, dense_layout_kernel(mode, device, compiled=compiled), n, k, DENSE_GROUP, dtype, optimize)


class QuantLinear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` packed for the fused kernel (``x`` of any leading shape).

    Made empty (:meth:`__init__`: buffers of the packed shapes on ``device``, ``meta`` for a skeleton) and
    filled by :meth:`load_rows` a block of rows at a time, or from a loaded ``nn.Linear`` (:meth:`from_linear`).
    ``kernel_device`` names the device the packed layout is for (the skeleton's buffers live on ``meta``).

    int8 (:func:`int8_kernel`): q8x8 (offload/q8x8.py: the codes as loaded, activations int8 per 32 values) or
    ``_weight_int8pack_mm`` (bf16 activations) on the codes buffer; FBGEMM on an x86 CPU: once filled,
    :meth:`finish` hands the codes and scales to FBGEMM (``quantized.linear_prepack``: its own packed copy, made
    from the codes a block of rows at a time, :func:`~expertcache.offload.fbgemm.fbgemm_prepack`; the activation
    quantised per call, per token) and drops the codes buffer (``opaque_bytes`` counts FBGEMM's copy
    instead). Activations are 8-bit where FBGEMM runs VNNI (int32 sums), 7-bit elsewhere (``reduce_range``: AVX2's
    ``vpmaddubsw`` sums pairs of u8 × s8 products in int16, which 8-bit activations can overflow).

    int4 on an AVX2 CPU with numba (:func:`~expertcache.offload.quant.dense_int4_kernel`; ``compiled`` False): the
    q4x8 layout and kernel (offload/q4x8.py: each row of x quantised to int8 per call, codes 4-bit), its layout name
    in :attr:`recipe` (so the dense cache never reads one layout's bytes as the other's); else torch's int4 kernel."""

    def __init__(self, n: int, k: int, mode: str, dtype: torch.dtype, *, bias: bool = False,
                 device: torch.device | str = "cpu", kernel_device: torch.device | str | None = None,
                 compiled: bool = False, optimize: str = "minmax", weight_only: bool = False) -> None:
        super().__init__()
        self.qm = _matrix(mode, n, k, dtype, kernel_device or device, optimize, compiled=compiled)
        self.kernel = (("q4x8" if self.qm.kernel == "q4x8" else "int4pack") if mode == "int4" else
                       int8_kernel(kernel_device or device, compiled=compiled, weight_only=weight_only))
        self._fbgemm = None  # FBGEMM's packed weight, a list of blocks of rows (after finish)
        self.opaque_bytes = 0
        self.reduce_range = not fbgemm_vnni()
        (ws, wd), (ss, sd) = self.qm.shapes()
        self.register_buffer("qweight", torch.empty(ws, dtype=wd, device=device), persistent=False)
        self.register_buffer("scales", torch.empty(ss, dtype=sd, device=device), persistent=False)
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.in_features, self.out_features = k, n

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, weight_only: bool = False) -> "QuantLinear":
        """Pack a loaded ``linear`` (its weight read a block of rows at a time; the bias copied)."""
        w = linear.weight.detach()
        q = cls(w.shape[0], w.shape[1], mode, w.dtype, bias=linear.bias is not None, device=w.device,
                weight_only=weight_only)
        q.load_rows(lambda a, b: w[a:b])
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach())
        q.finish()
        return q

    @property
    def recipe(self) -> str:
        """What the packed bytes depend on besides the weight (the dense cache's key)."""
        return (f"linear-{self.qm.mode}-g{self.qm.group}-{self.qm.optimize}-{self.qm.kernel}-"
                f"{str(self.qm.dtype).removeprefix('torch.')}")

    @torch.no_grad()
    def finish(self) -> None:
        """After the buffers are filled (:meth:`load_rows` or the dense cache): hand int8 codes to FBGEMM where
        that is the kernel (class docstring); otherwise nothing."""
        if self.kernel != "fbgemm" or self._fbgemm is not None or self.qweight.device.type != "cpu":
            return
        # the codes themselves, a block of FBGEMM_ROWS rows at a time (fbgemm.py): the transient is a block's
        # copies (FINISH_TRANSIENT), never a float copy of the matrix; FBGEMM takes any K: the zero padding is dropped
        self._fbgemm = fbgemm_prepack(self.qweight[:, :self.in_features], self.scales)
        # FBGEMM holds the N·K codes and N int32 column offsets: counted as the codes buffer it replaces (N·K_pad,
        # K_pad = K rounded up to 16), so a plan made from the skeleton (dense_bytes) equals the loaded model's
        self.opaque_bytes = self.qweight.numel()
        self.qweight = torch.empty(0, dtype=torch.int8)

    @torch.no_grad()
    def load_rows(self, rows_of: Callable[[int, int], torch.Tensor]) -> None:
        """Pack the weight [n, k] whose rows [a, b) ``rows_of(a, b)`` gives (any float dtype, any device) into
        this module's buffers, :data:`~expertcache.offload.quant.PACK_ROWS` rows at a time."""
        pack_matrix_into(lambda a, b: rows_of(a, b).to("cpu", torch.float32), self.qm, self.qweight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fbgemm is not None:
            # FBGEMM quantises its whole input with one scale: rows scaled to max |x| = 1 first make that one scale
            # per token (exact: the product is linear), so a prompt's large rows do not coarsen the small ones
            x_MK = x.reshape(-1, x.shape[-1]).float()
            m_M1 = x_MK.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
            y = (fbgemm_linear(x_MK / m_M1, self._fbgemm, self.reduce_range) * m_M1).to(x.dtype)
        elif self.kernel == q8x8.KERNEL:  # int8 activations per 32 values × int8 (offload/q8x8.py)
            y = q8x8.q8x8_mm(x.reshape(-1, x.shape[-1]), self.qweight, self.scales)
        else:
            y = qmm(x.reshape(-1, x.shape[-1]), self.qweight, self.scales, self.qm)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qm.mode} ({self.kernel}, {self.qm.kernel})"


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` as int8 rows: ``E[i] = q[i] · s[i]`` (``s = max|row| / 127`` in the compute dtype); or,
    ``mode="int4"``, int4 codes two a byte (even columns in the low nibble) with a scale and a zero per group of
    :data:`DENSE_GROUP` columns: ``E[i, g] = (q - 8) · s[i, g] + z[i, g]`` (``quantize_codes``, ``optimize``; D a
    multiple of the group). Made empty and filled by :meth:`load_rows`, or from a loaded ``nn.Embedding``
    (:meth:`from_embedding`)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, *, padding_idx: int | None = None,
                 device: torch.device | str = "cpu", mode: str = "int8", optimize: str = "minmax") -> None:
        super().__init__()
        if mode == "int4" and embedding_dim % (2 * DENSE_GROUP):
            raise ValueError(f"an int4 embedding needs D a multiple of {2 * DENSE_GROUP}, got {embedding_dim}")
        self.mode, self.optimize = mode, optimize
        v, d, g = num_embeddings, embedding_dim, DENSE_GROUP
        codes, scales = ((v, d), (v,)) if mode == "int8" else ((v, d // 2), (v, d // g))
        self.register_buffer("codes", torch.empty(codes, dtype=torch.int8 if mode == "int8" else torch.uint8,
                                                  device=device), persistent=False)
        self.register_buffer("scales", torch.empty(scales, dtype=dtype, device=device), persistent=False)
        if mode == "int4":
            self.register_buffer("zeros", torch.empty(scales, dtype=dtype, device=device), persistent=False)
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @property
    def recipe(self) -> str:
        dtype = str(self.scales.dtype).removeprefix("torch.")
        if self.mode == "int8":
            return f"embedding-int8-rows-{dtype}"
        return f"embedding-int4-g{DENSE_GROUP}-{self.optimize}-{dtype}"

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, mode: str = "int8", optimize: str = "minmax") -> "QuantEmbedding":
        w = emb.weight.detach()
        q = cls(w.shape[0], w.shape[1], w.dtype, padding_idx=emb.padding_idx, device=w.device, mode=mode,
                optimize=optimize)
        q.load_rows(lambda a, b: w[a:b])
        return q

    @torch.no_grad()
    def load_rows(self, rows_of: Callable[[int, int], torch.Tensor], *, rows: int = PACK_ROWS) -> None:
        """Quantise the table whose rows [a, b) ``rows_of(a, b)`` gives, ``rows`` rows at a time."""
        for a in range(0, self.num_embeddings, rows):
            b = min(self.num_embeddings, a + rows)
            w = rows_of(a, b).to("cpu", torch.float32)
            if self.mode == "int8":
                q, s, _ = quantize_codes(w, "int8", 0, self.scales.dtype)
                self.codes[a:b].copy_(q.to(torch.int8))
            else:
                q, s, z = quantize_codes(w, "int4", DENSE_GROUP, self.scales.dtype, optimize=self.optimize)
                self.codes[a:b].copy_((q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8))
                self.zeros[a:b].copy_(z)
            self.scales[a:b].copy_(s)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.mode == "int8":
            return self.codes[ids].to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)
        c = self.codes[ids]
        q = torch.stack([c & 0xF, c >> 4], dim=-1).view(*ids.shape, -1, DENSE_GROUP).to(self.scales.dtype)
        out = (q - 8) * self.scales[ids].unsqueeze(-1) + self.zeros[ids].unsqueeze(-1)
        return out.view(*ids.shape, self.embedding_dim)


def dense_targets(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module of what ``--quant-dense`` replaces: every ``nn.Linear`` under a ``self_attn``, ``lm_head``,
    and the input embedding (unless its rows are read on demand: :class:`~expertcache.offload.diskembed.DiskEmbedding`)."""
    out = {name: mod for name, mod in model.named_modules()
           if type(mod) is nn.Linear and (".self_attn." in f".{name}." or name == "lm_head")}
    emb = model.get_input_embeddings()
    for name, mod in model.named_modules():
        if mod is emb and not isinstance(mod, DiskEmbedding):  # rows read on demand: nothing to pack
            out[name] = mod
    return out


def quantize_dense(model: nn.Module, mode: str | None, optimize: str = "minmax") -> int:
    """Replace :func:`dense_targets` of ``model`` (weights loaded) with :class:`QuantLinear` /
    :class:`QuantEmbedding`, one module at a time (the peak is one block of rows more). Returns how many."""
    if mode in (None, "none"):
        return 0
    _check_mode(mode)
    targets = dense_targets(model)
    for name, mod in targets.items():
        m = _target_mode(name, mod, mode)
        _replace(model, name, QuantEmbedding.from_embedding(mod, m, optimize) if isinstance(mod, nn.Embedding)
                 else QuantLinear.from_linear(mod, m, weight_only=_weight_only(name, mode)))
    return len(targets)


def quantize_dense_skeleton(model: nn.Module, mode: str | None, device: torch.device | str, *,
                            compiled: bool = False, optimize: str = "minmax") -> dict[str, nn.Module]:
    """Replace :func:`dense_targets` of a ``meta``-device skeleton with empty :class:`QuantLinear` /
    :class:`QuantEmbedding` (packed for ``device``; allocated by ``model.to_empty``), so that loading packs
    each weight a block of rows at a time straight from the checkpoint and no full-precision copy of it is
    ever held. Returns {the replaced weight's state-dict name: the new module} (``load_rows`` fills it;
    :func:`expertcache.offload.loader.load_non_expert` takes this map)."""
    if mode in (None, "none"):
        return {}
    _check_mode(mode)
    out = {}
    for name, mod in dense_targets(model).items():
        w = mod.weight
        m = _target_mode(name, mod, mode)
        if isinstance(mod, nn.Embedding):
            new = QuantEmbedding(w.shape[0], w.shape[1], w.dtype, padding_idx=mod.padding_idx, device="meta", mode=m,
                                 optimize=optimize)
        else:
            new = QuantLinear(w.shape[0], w.shape[1], m, w.dtype, bias=mod.bias is not None, device="meta",
                              kernel_device=device, compiled=compiled, optimize=optimize,
                              weight_only=_weight_only(name, mode))
        _replace(model, name, new)
        out[f"{name}.weight"] = new
    return out


def _check_mode(mode: str) -> None:
    if mode not in DENSE_MODES:
        raise ValueError(f"--quant-dense must be one of {', '.join(DENSE_MODES)}, got {mode!r}")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


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
    total += sum(getattr(m, "opaque_bytes", 0) for m in model.modules())  # FBGEMM's packed copies
    for name, mod in targets.items():
        w, m = mod.weight, _target_mode(name, mod, mode)
        if isinstance(mod, nn.Embedding) and m == "int8":
            total += w.shape[0] * w.shape[1] + w.shape[0] * w.element_size()
        elif isinstance(mod, nn.Embedding):  # int4 codes two a byte, a scale and a zero per group
            total += w.shape[0] * w.shape[1] // 2 + 2 * w.shape[0] * (w.shape[1] // DENSE_GROUP) * w.element_size()
        else:
            total += sum(_matrix(m, w.shape[0], w.shape[1], w.dtype, "cpu").part_bytes())
    return total


def fbgemm_shapes(model: nn.Module, mode: str | None, device: torch.device | str, *,
                  compiled: bool = False) -> list[tuple[int, int, int]]:
    """(N, K, codes bytes) of each ``nn.Linear`` of ``model`` (a skeleton: nothing allocated) that
    :func:`quantize_dense_skeleton` with ``mode`` makes an FBGEMM :class:`QuantLinear` on ``device``: those whose
    :meth:`QuantLinear.finish` hands their codes (N × K_pad int8) to FBGEMM after loading."""
    if mode in (None, "none"):
        return []
    out = []
    for name, mod in dense_targets(model).items():
        if isinstance(mod, nn.Embedding) or _target_mode(name, mod, mode) != "int8" or \
                int8_kernel(device, compiled=compiled, weight_only=_weight_only(name, mode)) != "fbgemm":
            continue
        n, k = mod.weight.shape
        (ws, _), _ = _matrix("int8", n, k, mod.weight.dtype, device).shapes()
        out.append((n, k, ws[0] * ws[1]))
    return out


def dense_kernel_note(model: nn.Module) -> str | None:
    """The dense part's kernels, for the logs and rows: e.g. ``int8 fbgemm ×65, int8 embedding ×1``; None when
    nothing is quantised."""
    from collections import Counter

    c = Counter(f"{m.qm.mode} {m.kernel}" if isinstance(m, QuantLinear) else f"{m.mode} embedding"
                for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding)))
    return ", ".join(f"{k} ×{v}" for k, v in sorted(c.items())) or None

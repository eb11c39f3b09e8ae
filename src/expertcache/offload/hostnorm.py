"""One token's RMSNorm in one compiled call (the **host norm**), for runs whose dense part is quantised on the CPU.

A decode step at 8 OLMoE layers runs 33 RMSNorms (two a layer, q_norm and k_norm, the final one); transformers'
forward is seven torch ops a call (``to``, ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, ``to``, ``mul``), 80-200
µs a call on an AVX2 EPYC core -- 5-7 ms a token, as much as a sixth of the q4 preset's step. This module computes
the same thing in one numba ``cfunc`` called through ctypes (q4x8's style).

**Contract** (:func:`rms_norm`), x [..., D] holding one row (``x.numel() == D``), weight w [D] of x's dtype (bf16
or float32), eps as the module's ``variance_epsilon``:

    v = Σ x_i² / D   (x in float32, squares and sum in float64, rounded once to float32)
    h = x · (1 / sqrt(v + eps))   (float32: v + eps, sqrt and the division each rounded to float32)
    y = w · round(h)   (round: to x's dtype, nearest even; the product in float32, rounded once to x's dtype)

which is transformers' ``w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1) + eps)).to(x.dtype)`` except for
the sum's order and precision (torch adds float32 squares in its vector order): ``v`` may differ in its last float32
bits, so y may differ from transformers' by a few float32 units in the last place (float32 rows), or by one bf16 unit
in rare elements (bf16 rows: none in 400,000 random elements measured). That is why it is installed only where the
run's products already differ from transformers' (the dense part quantised: :func:`use_host_norms`'s caller), never
on a run the tests hold bit-for-bit equal to transformers.

**Which modules** (:func:`use_host_norms`): every module whose class name ends in ``RMSNorm``, with a ``weight``
[D] parameter, no bias, an ``eps`` or ``variance_epsilon``, and whose own forward agrees with the contract on a probe
row (random x, its own weight; within two units of x's dtype, else left alone: a norm computing something else --
Gemma's ``1 + w``, gpt-oss's product before the cast -- keeps its forward). Its forward then takes the kernel for
one-row CPU inputs of x's dtype equal to the weight's, and its own forward for anything else (prompts, grads,
devices, fp16).

Compiled on first use or by :func:`warm` (preflight, before the memory plan measures the process), cached on disk by
numba. :func:`enabled`: numba available and ``$EXPERTCACHE_HOST_NORM`` not ``0`` (``1`` or unset: on where it
applies; anything else refused in one line naming the variable).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch
from torch import nn

from expertcache import compiled

__all__ = ["HOST_NORM_VAR", "enabled", "warm", "rms_norm", "reference", "use_host_norms"]

#: turns the host norm off (``0``) or on (``1``, the default where it applies); any other value is refused
HOST_NORM_VAR = "EXPERTCACHE_HOST_NORM"
_KIND = {torch.float32: 0, torch.bfloat16: 1}
_FN: list = []


def enabled() -> bool:
    """Whether the host norm may run: numba available and ``$EXPERTCACHE_HOST_NORM`` not ``0``; ValueError (one
    line naming the variable) for a value other than 0 or 1."""
    got = os.environ.get(HOST_NORM_VAR, "").strip()
    if got not in ("", "0", "1"):
        raise ValueError(f"{HOST_NORM_VAR} must be 0 (off) or 1 (on), got {got!r}")
    return got != "0" and compiled.AVAILABLE


if compiled.AVAILABLE:
    from numba import carray, njit

    @njit(inline="always")
    def _round16(b):
        """float32 bits ``b`` (uint32) rounded to bf16, nearest even, kept in the high 16 bits."""
        return (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)

    @njit(inline="always")
    def _inv_rms(f, d, eps):
        """1 / sqrt(mean(f²) + eps): the squares summed in float64 (four running sums, added in order at the end),
        then every step rounded to float32."""
        s0, s1, s2, s3 = 0.0, 0.0, 0.0, 0.0
        d4 = d // 4 * 4
        for i in range(0, d4, 4):
            v0, v1, v2, v3 = np.float64(f[i]), np.float64(f[i + 1]), np.float64(f[i + 2]), np.float64(f[i + 3])
            s0 += v0 * v0
            s1 += v1 * v1
            s2 += v2 * v2
            s3 += v3 * v3
        for i in range(d4, d):
            v = np.float64(f[i])
            s0 += v * v
        s = ((s0 + s1) + s2) + s3
        v = np.float32(np.float32(np.float32(s) / np.float32(d)) + np.float32(eps))
        return np.float32(np.float32(1.0) / np.float32(np.sqrt(v)))

    def _norm_bf16(xp, wp, yp, d, eps):
        """y[d] = the module docstring's contract for bf16 x, w, y (their bits as uint16)."""
        x, w, y = carray(xp, d), carray(wp, d), carray(yp, d)
        bits = np.empty(2 * d, np.uint32)  # [x's float32 bits, then h's; w's float32 bits]
        f = bits.view(np.float32)
        for i in range(d):
            bits[i] = np.uint32(x[i]) << np.uint32(16)
            bits[d + i] = np.uint32(w[i]) << np.uint32(16)
        r = _inv_rms(f, d, eps)
        for i in range(d):
            f[i] = f[i] * r
        for i in range(d):
            bits[i] = _round16(bits[i])
        for i in range(d):
            f[i] = f[d + i] * f[i]
        for i in range(d):
            y[i] = np.uint16(_round16(bits[i]) >> np.uint32(16))

    def _norm_f32(xp, wp, yp, d, eps):
        """y[d] = the module docstring's contract for float32 x, w, y."""
        x, w, y = carray(xp, d), carray(wp, d), carray(yp, d)
        r = _inv_rms(x, d, eps)
        for i in range(d):
            y[i] = w[i] * np.float32(x[i] * r)


def _kernels():
    """(the bf16 kernel, the float32 one) as ctypes functions ``(x, w, y, d, eps)``: compiled on first use, cached
    on disk (compiled.cfunc)."""
    if not _FN:
        from numba import types as nt

        for fn, t in ((_norm_bf16, nt.uint16), (_norm_f32, nt.float32)):
            cf = compiled.cfunc(fn, (nt.CPointer(t), nt.CPointer(t), nt.CPointer(t), nt.int64, nt.float32), nt.void)
            _FN.append((cf, ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_float)(cf.address)))
    return _FN[0][1], _FN[1][1]


def warm() -> None:
    """Compile (or load from numba's cache) the kernels now (preflight: before the plan measures the process)."""
    _kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y (x's shape and dtype) of the module docstring's contract for one row ``x`` (``x.numel() == D``) and
    ``weight`` [D], both bf16 or both float32, on the CPU (read through their pointers: y has no autograd history)."""
    d = weight.shape[-1]
    if x.dtype not in _KIND or weight.dtype != x.dtype or x.numel() != d or weight.numel() != d:
        raise ValueError(f"the host norm takes one row of bf16 or float32 and a weight of its dtype and width, got "
                         f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    x, w = x.contiguous(), weight.contiguous()  # (no detach: two dispatched ops a call, and only pointers are read)
    y = torch.empty_like(x)
    _kernels()[1 - _KIND[x.dtype]](x.data_ptr(), w.data_ptr(), y.data_ptr(), d, eps)
    return y


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The contract in plain torch (the sum of squares in float64): what the tests hold the kernel to."""
    f = x.detach().float()
    v = (f.double() ** 2).sum(-1, keepdim=True).float() / x.shape[-1]
    h = f * torch.rsqrt(v + torch.tensor(eps, dtype=torch.float32))  # rsqrt: 1 / sqrt, each rounded to float32
    return (weight.detach().float() * h.to(x.dtype).float()).to(x.dtype)


def _eps(mod: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        v = getattr(mod, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _agrees(mod: nn.Module, eps: float, forward) -> bool:
    """Whether ``forward`` (the module's own) computes the contract on a probe row: within two units of the
    weight's dtype in every element (module docstring; float32 rows differ by a few units in the last place)."""
    w = mod.weight
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 1, w.shape[0], generator=g) * 3).to(w.dtype)
    with torch.no_grad():
        got = forward(x)
    if not isinstance(got, torch.Tensor) or got.shape != x.shape or got.dtype != x.dtype:
        return False
    want = reference(x, w, eps).float()
    unit = 2 * torch.finfo(w.dtype).eps * want.abs().clamp_min(torch.finfo(w.dtype).tiny)
    return bool(((got.float() - want).abs() <= unit).all())


class _HostNormForward:
    """A norm module's forward: the kernel for one CPU row of the weight's dtype, else its own forward."""

    __slots__ = ("mod", "own", "eps")

    def __init__(self, mod: nn.Module, own, eps: float) -> None:
        self.mod, self.own, self.eps = mod, own, eps

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        w = self.mod.weight
        if (args or kwargs or x.dtype is not w.dtype or x.numel() != w.shape[0] or x.device.type != "cpu"
                or w.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return self.own(x, *args, **kwargs)
        return rms_norm(x, w, self.eps)


def use_host_norms(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` (weights loaded) that qualifies (module docstring) the host norm's forward;
    returns how many. Nothing where :func:`enabled` is False. Its caller decides where it may apply: a run whose
    products already differ from transformers' (the dense part quantised on the CPU)."""
    if not enabled():
        return 0
    n = 0
    for mod in model.modules():
        w, eps = getattr(mod, "weight", None), _eps(mod)
        if (not type(mod).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor) or w.dim() != 1
                or w.dtype not in _KIND or w.device.type != "cpu" or getattr(mod, "bias", None) is not None
                or eps is None or isinstance(mod.forward, _HostNormForward)):
            continue
        own = mod.forward
        if _agrees(mod, eps, own):
            mod.forward = _HostNormForward(mod, own, eps)
            n += 1
    return n

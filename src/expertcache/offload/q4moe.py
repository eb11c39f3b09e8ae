"""One token's whole MoE step on q4x8 int4 experts in one kernel call (the **fused** one-token path): for x [D] and
the U experts the step computes, each resident in the q4x8 layout (:mod:`~expertcache.offload.q4x8`,
:class:`~expertcache.offload.quant.QuantLayout`), with routing weights w_u,

    out[D] = Σ_u w_u · down_u( silu(gate_u(x)) * up_u(x) )

where the per-expert path (``quant.quant_mlp``) makes two ctypes calls and about ten torch ops per expert, then a
stack, a scale and U adds to combine them (step.py ``CacheSteps._serve_one``).

**Contract** (:func:`fused_moe`; tests/test_q4moe.py checks it against plain torch from the dequantised codes):

- x is quantised to int8 **once** (q4x8's rule: ``a = max|x| / 127``, ``xq = round(x / a)``, half to even) for
  every expert's gate_up product, whose rows (gate rows, then up rows, each half padded to ``f_pad`` with rows of
  scale 0 and zero 0: exact zeros) come out in float32, never rounded to x's dtype;
- each expert's activation ``h = silu(gate) * up`` [f_pad] stays float32 (``silu(g) = g / (1 + exp(-g))``; the
  padding rows give 0) and is quantised to int8 the same way for its down product (K = f_pad, as the per-expert
  path's); the down product's D rows come out in float32 (its rows past D, N padding, are not computed);
- the weighted sum runs in float32 in ascending position u (the caller passes the experts in ascending expert id,
  transformers' order): ``acc = 0; acc += w_u · y_u`` per u, rounded once to x's dtype (bf16: round to nearest
  even, as torch converts).

So it differs from the per-expert path only by that path's roundings to x's dtype (gate, up, the activation, each
expert's output, the running sum): within bf16 rounding. x's K padding (D up to a multiple of G) is zeros, as in
q4x8. The experts' bytes are read where they lie: their codes' and scales' addresses are passed as int64 arrays
(the slot views' ``data_ptr()``), the weights as float32.

**Threads**: with ``threads`` > 1 (default ``torch.get_num_threads()``, at most U) the experts run on a team of
that many threads (:func:`team.run <expertcache.offload.team.run>`: torch's own OpenMP threads where found, else a
small pool), each taking the next expert from a shared counter and writing its float32 output into that expert's
row of one [U, D] buffer; the weighted sum then runs in one more call, in ascending u, after every expert is done:
the one-thread result bit for bit, whatever the threads' timing. (Not numba's parallel backend: its threads next
to torch's slowed torch 50-100×; nor threads of our own where torch's team is found: torch's OpenMP workers spin
after each op, and a thread of ours beside them made a layer slower with 2 threads than with 1.)

A numba ``cfunc`` called through ctypes (q4x8's style), on q4x8's AVX2 intrinsics where :func:`q4x8.use_avx2`,
else its plain loop (the same integer sums); compiled on first use or by :func:`warm`, cached on disk keyed by
this file and the package modules it imports (``compiled``). :func:`enabled`: ``$EXPERTCACHE_FUSED_MOE`` (``0``:
off, the per-expert path; ``1`` or unset: on where it applies), validated once per start (preflight).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch
import torch.nn.functional as F

from expertcache import compiled
from expertcache.offload import q4x8, team

__all__ = ["FUSED_VAR", "enabled", "silu_gated", "FusedMoE", "fused_moe", "warm", "attach"]

#: turns the fused one-token path off (``0``) or on (``1``, the default); any other value is refused
FUSED_VAR = "EXPERTCACHE_FUSED_MOE"
_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}
_CFUNCS: dict[bool, tuple] = {}


def enabled() -> bool:
    """Whether the fused path may run: numba available and ``$EXPERTCACHE_FUSED_MOE`` not ``0``; ValueError (one
    line naming the variable) for a value other than 0 or 1."""
    got = os.environ.get(FUSED_VAR, "").strip()
    if got not in ("", "0", "1"):
        raise ValueError(f"{FUSED_VAR} must be 0 (off) or 1 (on), got {got!r}")
    return got != "0" and q4x8.available()


def silu_gated(act) -> bool:
    """Whether ``act`` is SiLU (torch's module or function, transformers' ``SiLUActivation``): the activation the
    kernel computes. Others (gpt-oss's clamped SwiGLU, GELU) keep the per-expert path."""
    return act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


if compiled.AVAILABLE:
    from numba import carray, njit, types
    from numba.extending import intrinsic

    from expertcache.offload.q4x8 import (BLOCK, _dot_plain, _offsets, _quantise, _rows4_avx2, _scale_f32,
                                          _store_f32)
    from expertcache.offload.team import pointer, take

    @intrinsic
    def _addr(typingctx, a):
        """An int64 address as a void pointer (for ``carray``)."""
        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
        return types.voidptr(a), codegen

    @njit(inline="always")
    def _mv_avx2(codes, sz16, sz32, kind, n4, k_pad, group, xq, sxq, xs, a, corr, y, yb):
        """y[yb + n] (float32), n < n4, of one quantised row (xq in rows4_avx2's pair order), four rows a call."""
        ng, nblk, half = k_pad // group, group // BLOCK, k_pad // 2
        for g in range(ng):
            corr[8 * g] = -8 * sxq[g]
        for n0 in range(0, n4, 4):
            _rows4_avx2(codes, n0 * half, half, xq, 0, sz16, n0 * ng * 2, kind, corr, 0, xs, 0, a, ng, nblk, y,
                        yb + n0)

    @njit(inline="always")
    def _mv_plain(codes, sz16, sz32, kind, n4, k_pad, group, xq, sxq, xs, a, corr, y, yb):
        """The same on the plain loop (xq in order): q4x8's ``_kernel_plain`` for one row."""
        ng, nblk, half = k_pad // group, group // BLOCK, k_pad // 2
        for n in range(n4):
            off, zero = _offsets(sz16, sz32, kind, n, 0, sxq, xs, ng)
            main = np.float32(0.0)
            for g in range(ng):
                d = _dot_plain(codes, n * half + g * (group // 2), xq, g * group, nblk)
                main += _scale_f32(sz16, sz32, (n * ng + g) * 2, kind) * np.float32(d)
            y[yb + n] = a * (main + off) + zero

    @njit(inline="always")
    def _body(mv, pairs, xp, xf, xkind, d, u0, u1, n_exp, gcp, gsp, dcp, dsp, skind, f_pad, group, wp, hp, yp, yf,
              combine, ctr, dyn):
        """Experts [u0, u1) into rows u of h [n_exp, n4] (float32) -- each next u taken from the work counter
        ``ctr[0]`` (team.take) if ``dyn``, else u0, u0 + 1, ...; then, if ``combine``, the weighted sum of all
        n_exp rows into y [d] in x's kind (module docstring)."""
        kx = (d + group - 1) // group * group  # gate_up's K, padded to G
        n4, f2 = (d + 3) // 4 * 4, 2 * f_pad
        ngx, ngf = kx // group, f_pad // group
        h = carray(hp, n_exp * n4)
        if u1 > u0:
            x16, x32 = carray(xp, d), carray(xf, d)
            gc, gs, dc, ds = carray(gcp, n_exp), carray(gsp, n_exp), carray(dcp, n_exp), carray(dsp, n_exp)
            ng = max(ngx, ngf)
            xq, sxq, xs, xa = np.empty(kx, np.int8), np.empty(ngx, np.int32), np.empty(ngx, np.float32), \
                np.empty(1, np.float32)
            aq, asxq, axs, aa = np.empty(f_pad, np.int8), np.empty(ngf, np.int32), np.empty(ngf, np.float32), \
                np.empty(1, np.float32)
            corr = np.zeros(8 * ng, np.int32)
            gu, act, none16 = np.empty(f2, np.float32), np.empty(f_pad, np.float32), np.empty(1, np.int16)
            _quantise(x16, x32, xkind, 1, d, kx, group, xq, sxq, xs, xa, pairs)  # once for every expert
            one = np.float32(1.0)
            u = take(ctr, 0) if dyn else u0
            while u < u1:
                codes = carray(_addr(gc[u]), f2 * kx // 2, np.uint8)
                s16, s32 = carray(_addr(gs[u]), f2 * ngx * 2, np.int16), carray(_addr(gs[u]), f2 * ngx * 2, np.float32)
                mv(codes, s16, s32, skind, f2, kx, group, xq, sxq, xs, xa[0], corr, gu, 0)
                for j in range(f_pad):  # silu(gate) * up in float32 (padding rows: 0 * 0)
                    g = gu[j]
                    act[j] = g / (one + np.exp(-g)) * gu[f_pad + j]
                _quantise(none16, act, 0, 1, f_pad, f_pad, group, aq, asxq, axs, aa, pairs)
                codes = carray(_addr(dc[u]), n4 * f_pad // 2, np.uint8)
                s16, s32 = carray(_addr(ds[u]), n4 * ngf * 2, np.int16), carray(_addr(ds[u]), n4 * ngf * 2, np.float32)
                mv(codes, s16, s32, skind, n4, f_pad, group, aq, asxq, axs, aa[0], corr, h, u * n4)
                u = take(ctr, 0) if dyn else u + 1
        if combine:
            w = carray(wp, n_exp)
            acc = np.zeros(d, np.float32)
            for u in range(n_exp):  # ascending u, one rounding at the end
                wu = w[u]
                for i in range(d):
                    acc[i] += wu * h[u * n4 + i]
            y16, y32 = carray(yp, d), carray(yf, d)
            for i in range(d):
                _store_f32(y16, y32, i, acc[i], xkind)

    _p16, _p32, _p64 = pointer(types.int16), pointer(types.float32), pointer(types.int64)

    @njit(inline="always")
    def _team(mv, pairs, data):
        """The experts of one call on a team of threads (team.py): ``data`` int64 [counter, x, x's kind, d, n_exp,
        gate_up codes, gate_up scales, down codes, down scales (address arrays), scales' kind, f_pad, G, h]."""
        a = carray(data, 13, np.int64)
        _body(mv, pairs, _p16(a[1]), _p32(a[1]), a[2], a[3], 0, a[4], a[4], _p64(a[5]), _p64(a[6]), _p64(a[7]),
              _p64(a[8]), a[9], a[10], a[11], _p32(a[12]), _p32(a[12]), _p16(a[12]), _p32(a[12]), False, a, True)

    # the two paths' kernels (module level, so numba caches them; the AVX2 one never compiled where it is missing)
    def _fused_avx2(xp, xf, xkind, d, u0, u1, n_exp, gcp, gsp, dcp, dsp, skind, f_pad, group, wp, hp, yp, yf,
                    combine):
        _body(_mv_avx2, True, xp, xf, xkind, d, u0, u1, n_exp, gcp, gsp, dcp, dsp, skind, f_pad, group, wp, hp, yp,
              yf, combine, np.zeros(1, np.int64), False)

    def _fused_plain(xp, xf, xkind, d, u0, u1, n_exp, gcp, gsp, dcp, dsp, skind, f_pad, group, wp, hp, yp, yf,
                     combine):
        _body(_mv_plain, False, xp, xf, xkind, d, u0, u1, n_exp, gcp, gsp, dcp, dsp, skind, f_pad, group, wp, hp,
              yp, yf, combine, np.zeros(1, np.int64), False)

    def _team_avx2(data):
        _team(_mv_avx2, True, data)

    def _team_plain(data):
        _team(_mv_plain, False, data)


def _compile(body, sig):
    """``body`` as a numba CFunc of ``sig``, cached on disk keyed by this file and its package imports."""
    from numba.core import sigutils
    from numba.core.ccallback import CFunc

    cf = CFunc(body, sigutils.normalize_signature(sig), locals={}, options={"nopython": True})
    try:
        cf._cache = compiled._dependency_cache(body)  # what cache=True sets, keyed deeper (compiled.py)
    except RuntimeError:  # no writable cache location: compiled per process
        pass
    cf.compile()
    return cf


def _kernel(avx2: bool):
    """(the compiled kernel of the AVX2 or the plain path as a ctypes function, the address of its team kernel
    ``void(void *data)``: team.py), compiled on first use, cached on disk (keyed by this file and its package
    imports: an edit of q4x8.py compiles it again)."""
    got = _CFUNCS.get(avx2)
    if got is None:
        from numba import types as nt

        p, i64, f32, i16 = nt.CPointer, nt.int64, nt.float32, nt.int16
        sig = nt.void(p(i16), p(f32), i64, i64, i64, i64, i64, p(i64), p(i64), p(i64), p(i64), i64, i64, i64,
                      p(f32), p(f32), p(i16), p(f32), i64)
        cf = _compile(_fused_avx2 if avx2 else _fused_plain, sig)
        tf = _compile(_team_avx2 if avx2 else _team_plain, nt.void(nt.voidptr))
        ptr, c64 = ctypes.c_void_p, ctypes.c_int64
        proto = ctypes.CFUNCTYPE(None, ptr, ptr, c64, c64, c64, c64, c64, ptr, ptr, ptr, ptr, c64, c64, c64, ptr, ptr,
                                 ptr, ptr, c64)
        got = _CFUNCS.setdefault(avx2, (cf, tf, proto(cf.address), tf.address))
    return got[2], got[3]


def warm() -> None:
    """Compile (or load from numba's cache) this CPU's path now (preflight: before the plan measures the process)."""
    _kernel(q4x8.use_avx2())


def fused_moe(x_D: torch.Tensor, views: list, w_U, d: int, f_pad: int, group: int, *, threads: int | None = None,
              avx2: bool | None = None) -> torch.Tensor:
    """out [d] in x's dtype (module docstring) for x [d] and the experts' q4x8 views ``views`` (each (gate_up codes,
    gate_up scales, down codes, down scales): ``QuantLayout.views``, contiguous, in ascending expert id) with float32
    weights ``w_U`` (any sequence of U numbers). ``threads``: default ``torch.get_num_threads()``; ``avx2``: force
    the AVX2 (True) or the plain path (False), default :func:`q4x8.use_avx2`."""
    x = x_D.detach()
    if x.dtype not in _KIND:
        x = x.float()
    x = x.contiguous()
    u = len(views)
    gc, gs, dc, ds = (np.fromiter((v[i].data_ptr() for v in views), np.int64, u) for i in range(4))
    w = np.ascontiguousarray(w_U, dtype=np.float32)
    kind, skind = _KIND[x.dtype], _KIND[views[0][1].dtype]
    n4 = -(-d // 4) * 4
    h = np.empty(max(u, 1) * n4, np.float32)
    y = torch.empty(d, dtype=x.dtype)
    fn, on_team = _kernel(q4x8.use_avx2() if avx2 is None else avx2)
    px, py = x.data_ptr(), y.data_ptr()
    args = (gc.ctypes.data, gs.ctypes.data, dc.ctypes.data, ds.ctypes.data, skind, f_pad, group, w.ctypes.data,
            h.ctypes.data, py, py)
    n = team.cut(u, torch.get_num_threads() if threads is None else threads)
    if n == 1:
        fn(px, px, kind, d, 0, u, u, *args, 1)
    else:  # the experts on a team of n threads (team.py), each taking the next expert; then the weighted sum
        data = np.array([0, px, kind, d, u, *args[:7], h.ctypes.data], np.int64)
        team.run(on_team, data.ctypes.data, n)
        fn(px, px, kind, d, 0, 0, u, *args, 1)  # in ascending u, once every expert is done
    return y if y.dtype == x_D.dtype else y.to(x_D.dtype)


class FusedMoE:
    """The fused one-token MoE product of one layer's q4x8 experts (``layout``: its QuantLayout):
    ``fused(x_D, views, w_U) -> out [D]`` (:func:`fused_moe`)."""

    def __init__(self, layout) -> None:
        self.d, self.f_pad, self.group = layout.d, layout.f_pad, layout.group

    def __call__(self, x_D: torch.Tensor, views: list, w_U) -> torch.Tensor:
        return fused_moe(x_D, views, w_U, self.d, self.f_pad, self.group)

    def step(self, x_D: torch.Tensor, views_of: dict, ids_K: list[int], w_K: torch.Tensor) -> torch.Tensor:
        """One token's step: ``views_of`` {expert: its views}, combined in ascending expert id with each one's
        weight in ``w_K`` (at its position in the routed ids ``ids_K``)."""
        es = sorted(views_of)
        w = w_K.detach().to("cpu", torch.float32).numpy()
        at = {e: i for i, e in enumerate(ids_K)}
        return self(x_D, [views_of[e] for e in es], [w[at[e]] for e in es])


def attach(mlp, layout, act):
    """``mlp`` (a layer's per-expert MLP on ``layout``'s slots), given ``mlp.fused`` (a :class:`FusedMoE`) where the
    fused path applies: q4x8 int4 experts, a SiLU-gated activation, :func:`enabled`."""
    if layout.mode == "int4" and layout.kernel == q4x8.KERNEL and silu_gated(act) and enabled():
        mlp.fused = FusedMoE(layout)
    return mlp

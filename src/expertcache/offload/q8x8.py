"""int8 activations × int8 weights for the int8 dense products on AVX2 CPUs, in numba (the ``q8x8`` dense kernel):
what llama.cpp's Q8_0 × Q8_0 dot product does, for the int8 attention projections and ``lm_head`` of ``--quant-dense
int8`` (the ``q4`` preset) and ``int4-head8``'s int8 ``lm_head`` (the ``q4m`` preset) on AVX2 x86 CPUs without
VNNI (AMD Zen 2/3, laptops, older Xeons), where FBGEMM quantises activations to 7 bits (``reduce_range``) and
torch's weight-only ``_weight_int8pack_mm`` runs at about bf16's speed.

**Layout**: the int8 layout of ``offload/quant.py`` unchanged (weight int8 [N, K_pad] per output channel, codes
in [-127, 127], K_pad a multiple of 16; scales [N] in the compute dtype), so the dense cache's bytes are the same
whichever int8 kernel runs them (FBGEMM, ``_weight_int8pack_mm`` or this one).

**Product** (:func:`q8x8_mm`), x [M, K'] with K' ≤ K_pad (the missing columns are zeros), one thread: each row of
x is quantised to int8 **per block of 32** (``a_b = max|x_b| / 127``, ``xq = round(x / a_b)`` half to even; a block
of zeros gets a_b = 1, xq = 0) -- llama.cpp's Q8_0 activations, finer than its Q8_K (256) and than FBGEMM's one
scale per token; then

    y[m, n] = s[n] · Σ_b a[m, b] · Σ_{k∈b} q[n, k]·xq[m, k]

The integer sums run on AVX2's ``vpmaddubsw`` with the sign trick (``|xq|`` as u8 times ``sign(xq)·q`` as s8: at
most 2·127·127 per int16 pair, no saturation) and one ``vpmaddwd`` by ones per block (int32), four weight rows at a
time sharing each block's loads of x, each row's block sums converted once and accumulated with its block scale in
its own float32 vector (``rows4_q8``); a last half block (K_pad ≡ 16 mod 32) and CPUs without AVX2 take a plain
loop with the same integer sums. x is read in its dtype, y written in it (float32 sums, rounded once).

**Threads**: with ``threads`` > 1 (default ``torch.get_num_threads()``) x is quantised once, then the output
rows run on a team of threads (:func:`team.run <expertcache.offload.team.run>`: torch's own OpenMP threads where
found), each taking the next :data:`CHUNK` rows from a shared counter; a row's sums run in the same order on
whichever thread (the AVX2 quads are the one-thread quads): the one-thread result bit for bit.

**Numerical contract**: the result equals ``Σ_b (a_b·xq_b) @ q_b.T · s`` to float32 rounding; against
``x @ (q·s).T`` it differs only by the activation's rounding, at most ``a_b / 2`` per element of x.

Compiled on first use or by :func:`warm` (``preflight.compile_kernels``, before the memory plan measures the
process), cached on disk by numba (keyed by this file and q4x8.py, whose helpers it inlines); without numba :func:`available` is False and the int8 dense part keeps FBGEMM /
``_weight_int8pack_mm`` (``qlinear.int8_kernel``).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from expertcache import compiled
from expertcache.offload import q4x8, team

__all__ = ["KERNEL", "ABLOCK", "available", "use_avx2", "warm", "q8x8_mm", "block_sums"]

#: the kernel's name (``QuantLinear.kernel``; the layout stays the int8 one)
KERNEL = "q8x8"
#: activation block: one int8 scale per 32 values of a row of x (llama.cpp's Q8_0)
ABLOCK = 32
#: output rows a thread takes at a time when a product runs on several (a multiple of 4: rows4_q8's quads)
CHUNK = 64
_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}
_CFUNCS: dict[bool, tuple] = {}
_SCRATCH = threading.local()


def available() -> bool:
    """numba importable and not switched off (``EXPERTCACHE_NO_NUMBA``)."""
    return compiled.AVAILABLE


def use_avx2() -> bool:
    """The AVX2 path's condition: q4x8's (an x86-64 CPU with avx2 and numba's target one with AVX2)."""
    return q4x8.use_avx2()


def _intrinsics():
    """rows4_q8: four outputs of one row of x on AVX2 (defined where numba is; compiled with a kernel)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    v32i8, v16i16, v8i32, v8f32 = (ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8),
                                   ir.VectorType(f32, 8))

    def wide(builder, v):
        return builder.sext(v, i64) if v.type != i64 else v

    def fn(builder, name, ret, *args):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(args)), name)

    def ptr(context, builder, ty, val, at):
        return builder.gep(context.make_array(ty)(context, builder, val).data, [wide(builder, at)])

    @intrinsic
    def rows4_q8(typingctx, w, wb, stride, xa, xs, xb, sc, sb, nblk, out, ob):
        """Σ_b sc[b]·Σ_{k∈b} q·xq of four weight rows (int8, from byte ``wb`` of ``w``, rows ``stride`` bytes
        apart) and one row of x (``xa``: |xq| as uint8, ``xs``: xq as int8, both from ``xb``; ``sc``: its block
        scales from ``sb``) over ``nblk`` whole blocks of 32, stored as float32 at ``out[ob..ob+3]``."""
        def codegen(context, builder, sig, args):
            w_v, wb_v, st_v, xa_v, xs_v, xb_v, sc_v, sb_v, nb_v, out_v, ob_v = args
            wbase = ptr(context, builder, sig.args[0], w_v, wb_v)
            abase = ptr(context, builder, sig.args[3], xa_v, xb_v)
            sbase = ptr(context, builder, sig.args[4], xs_v, xb_v)
            scp = ptr(context, builder, sig.args[6], sc_v, sb_v)
            outp = ptr(context, builder, sig.args[9], out_v, ob_v)
            stride, nblk = wide(builder, st_v), wide(builder, nb_v)
            madd_ub = fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, v32i8, v32i8)
            madd_wd = fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, v16i16, v16i16)
            psign = fn(builder, "llvm.x86.avx2.psign.b", v32i8, v32i8, v32i8)
            fma8 = fn(builder, "llvm.fmuladd.v8f32", v8f32, v8f32, v8f32, v8f32)
            prefetch = fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), i8.as_pointer(), i32, i32, i32)
            ones = ir.Constant(v16i16, [1] * 16)
            rows = [builder.gep(wbase, [builder.mul(stride, ir.Constant(i64, r))]) for r in range(4)]
            ahead = builder.mul(stride, ir.Constant(i64, 8))  # the same place of the next quad but one
            faccs = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, [0.0] * 8)) for _ in range(4)]
            with cgutils.for_range(builder, nblk) as loop:
                at = builder.mul(loop.index, ir.Constant(i64, 32))
                xa = builder.load(builder.bitcast(builder.gep(abase, [at]), v32i8.as_pointer()), align=1)
                xs = builder.load(builder.bitcast(builder.gep(sbase, [at]), v32i8.as_pointer()), align=1)
                s = builder.load(builder.gep(scp, [loop.index]))
                splat = builder.shuffle_vector(builder.insert_element(ir.Constant(v8f32, None), s, ir.Constant(i32, 0)),
                                               ir.Constant(v8f32, None), ir.Constant(v8i32, [0] * 8))
                for row, facc in zip(rows, faccs):
                    builder.call(prefetch, [builder.gep(row, [builder.add(ahead, at)]), ir.Constant(i32, 0),
                                            ir.Constant(i32, 3), ir.Constant(i32, 1)])
                    q = builder.load(builder.bitcast(builder.gep(row, [at]), v32i8.as_pointer()), align=1)
                    p = builder.call(madd_wd, [builder.call(madd_ub, [xa, builder.call(psign, [q, xs])]), ones])
                    builder.store(builder.call(fma8, [builder.sitofp(p, v8f32), splat, builder.load(facc)]), facc)
            red = fn(builder, "llvm.vector.reduce.fadd.v8f32", f32, f32, v8f32)
            for r in range(4):
                builder.store(builder.call(red, [ir.Constant(f32, 0.0), builder.load(faccs[r])]),
                              builder.gep(outp, [ir.Constant(i64, r)]))
            return context.get_dummy_value()
        return types.none(w, wb, stride, xa, xs, xb, sc, sb, nblk, out, ob), codegen

    return rows4_q8


if compiled.AVAILABLE:
    from numba import carray, njit, types

    from expertcache.offload.team import pointer, take

    _rows4_q8 = _intrinsics()
    _scale_f32, _store_f32 = q4x8._scale_f32, q4x8._store_f32

    @njit(inline="always")
    def _quantise(x16, x32, xkind, m_rows, k_in, k_pad, xa, xs, sc):
        """Each row of x to int8 per block of ABLOCK (module docstring): |xq| (uint8) and xq (int8) [M·k_pad]
        (zeros past k_in), the block scales [M·nb]."""
        nb = (k_pad + ABLOCK - 1) // ABLOCK
        for m in range(m_rows):
            for b in range(nb):
                lo, hi = b * ABLOCK, min(k_in, (b + 1) * ABLOCK)
                big = np.float32(0.0)
                for k in range(lo, hi):
                    big = max(big, abs(_scale_f32(x16, x32, m * k_in + k, xkind)))
                a = np.float32(big / np.float32(127.0)) if big > 0 else np.float32(1.0)
                sc[m * nb + b] = a
                for k in range(lo, min(k_pad, (b + 1) * ABLOCK)):
                    r = np.int32(0)
                    if k < hi:
                        r = min(127, max(-127, np.int32(np.rint(np.float32(_scale_f32(x16, x32, m * k_in + k, xkind)
                                                                            / a)))))
                    xs[m * k_pad + k] = r
                    xa[m * k_pad + k] = abs(r)

    @njit(inline="always")
    def _tail(w, n, k_pad, xs, m, first, sc, nb):
        """Σ over the blocks from code ``first`` to K_pad of row n and row m of x, in the plain loop."""
        tot = np.float32(0.0)
        for b in range(first // ABLOCK, nb):
            d = np.int32(0)
            for k in range(b * ABLOCK, min(k_pad, (b + 1) * ABLOCK)):
                d += np.int32(w[n * k_pad + k]) * np.int32(xs[m * k_pad + k])
            tot += sc[m * nb + b] * np.float32(d)
        return tot

    @njit(inline="always")
    def _rows_plain(w, s16, s32, skind, lo, hi, n_rows, k_pad, m_rows, xa, xs, sc, y16, y32, ykind, four):
        """Rows [lo, hi) of y on the plain loop."""
        nb = (k_pad + ABLOCK - 1) // ABLOCK
        for n in range(lo, hi):
            for m in range(m_rows):
                v = _tail(w, n, k_pad, xs, m, 0, sc, nb)
                _store_f32(y16, y32, m * n_rows + n, v * _scale_f32(s16, s32, n, skind), ykind)

    @njit(inline="always")
    def _rows_avx2(w, s16, s32, skind, lo, hi, n_rows, k_pad, m_rows, xa, xs, sc, y16, y32, ykind, four):
        """Rows [lo, hi) of y (lo a multiple of 4): those below the last whole quad of all n_rows on rows4_q8, the
        rest on the plain loop -- so a row's sums run in one order whichever range it falls in."""
        nb = (k_pad + ABLOCK - 1) // ABLOCK
        whole = k_pad // ABLOCK
        n4 = n_rows - n_rows % 4
        for n0 in range(lo, min(hi, n4), 4):
            for m in range(m_rows):
                _rows4_q8(w, n0 * k_pad, k_pad, xa, xs, m * k_pad, sc, m * nb, whole, four, 0)
                for r in range(4):
                    v = four[r]
                    if whole < nb:
                        v += _tail(w, n0 + r, k_pad, xs, m, whole * ABLOCK, sc, nb)
                    _store_f32(y16, y32, m * n_rows + n0 + r, v * _scale_f32(s16, s32, n0 + r, skind), ykind)
        _rows_plain(w, s16, s32, skind, max(lo, n4), hi, n_rows, k_pad, m_rows, xa, xs, sc, y16, y32, ykind, four)

    @njit(inline="always")
    def _product(rows, xp, xf, xkind, m_rows, k_in, wp, sp, sf, skind, n_rows, k_pad, yp, yf, ykind, ap, qp, cp, quant,
                 ctr, dyn):
        """x quantised into (xa, xs, sc) if ``quant``; then the rows of y: all, or if ``dyn`` chunks of CHUNK rows
        taken from the work counter ``ctr[0]`` (team.take) until none is left."""
        x16, x32 = carray(xp, m_rows * k_in), carray(xf, m_rows * k_in)
        w, s16, s32 = carray(wp, n_rows * k_pad), carray(sp, n_rows), carray(sf, n_rows)
        y16, y32 = carray(yp, m_rows * n_rows), carray(yf, m_rows * n_rows)
        nb = (k_pad + ABLOCK - 1) // ABLOCK
        xa, xs, sc = carray(ap, m_rows * k_pad), carray(qp, m_rows * k_pad), carray(cp, m_rows * nb)
        if quant:
            _quantise(x16, x32, xkind, m_rows, k_in, k_pad, xa, xs, sc)
        four = np.empty(4, dtype=np.float32)
        if not dyn:
            rows(w, s16, s32, skind, 0, n_rows, n_rows, k_pad, m_rows, xa, xs, sc, y16, y32, ykind, four)
            return
        c = take(ctr, 0)
        while c * CHUNK < n_rows:
            rows(w, s16, s32, skind, c * CHUNK, min(n_rows, (c + 1) * CHUNK), n_rows, k_pad, m_rows, xa, xs,
                  sc, y16, y32, ykind, four)
            c = take(ctr, 0)

    _p8, _pu8, _p16, _p32 = (pointer(types.int8), pointer(types.uint8), pointer(types.int16),
                             pointer(types.float32))

    @njit(inline="always")
    def _team(rows, data):
        """The rows of one product on a team of threads (team.py), x already quantised: ``data`` int64 [counter,
        x, x's kind, M, K', weight, scales, scales' kind, N, K_pad, y, y's kind, |xq|, xq, block scales]."""
        a = carray(data, 15, np.int64)
        _product(rows, _p16(a[1]), _p32(a[1]), a[2], a[3], a[4], _p8(a[5]), _p16(a[6]), _p32(a[6]), a[7], a[8], a[9],
                 _p16(a[10]), _p32(a[10]), a[11], _pu8(a[12]), _p8(a[13]), _p32(a[14]), False, a, True)

    def _kernel_avx2(xp, xf, xkind, m_rows, k_in, wp, sp, sf, skind, n_rows, k_pad, yp, yf, ykind, ap, qp, cp):
        _product(_rows_avx2, xp, xf, xkind, m_rows, k_in, wp, sp, sf, skind, n_rows, k_pad, yp, yf, ykind, ap, qp, cp,
                 True, np.zeros(1, np.int64), False)

    def _kernel_plain(xp, xf, xkind, m_rows, k_in, wp, sp, sf, skind, n_rows, k_pad, yp, yf, ykind, ap, qp, cp):
        _product(_rows_plain, xp, xf, xkind, m_rows, k_in, wp, sp, sf, skind, n_rows, k_pad, yp, yf, ykind, ap, qp, cp,
                 True, np.zeros(1, np.int64), False)

    def _team_avx2(data):
        _team(_rows_avx2, data)

    def _team_plain(data):
        _team(_rows_plain, data)


def _kernel(avx2: bool):
    """(the compiled kernel of the AVX2 or the plain path, a numba cfunc called through ctypes; the address of its
    team kernel ``void(void *data)``: team.py), cached on disk."""
    got = _CFUNCS.get(avx2)
    if got is None:
        from numba import types

        p, i64, f32, i16 = types.CPointer, types.int64, types.float32, types.int16
        sig = types.void(p(i16), p(f32), i64, i64, i64, p(types.int8), p(i16), p(f32), i64, i64, i64, p(i16), p(f32),
                         i64, p(types.uint8), p(types.int8), p(f32))
        cf = compiled.cfunc(_kernel_avx2 if avx2 else _kernel_plain, sig.args, sig.return_type)
        tf = compiled.cfunc(_team_avx2 if avx2 else _team_plain, (types.voidptr,), types.void)
        c, i = ctypes.c_void_p, ctypes.c_int64
        proto = ctypes.CFUNCTYPE(None, c, c, i, i, i, c, c, c, i, i, i, c, c, i, c, c, c)
        got = _CFUNCS.setdefault(avx2, (cf, tf, proto(cf.address), tf.address))
    return got[2], got[3]


def warm() -> None:
    """Compile (or load from numba's cache) this CPU's path now, not at the first product."""
    _kernel(use_avx2())


def _scratch(m: int, k_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    need = (m * k_pad, m * k_pad, m * (-(-k_pad // ABLOCK)))
    got = getattr(_SCRATCH, "bufs", None)
    if got is None or any(t.numel() < k for t, k in zip(got, need)):
        have = [t.numel() for t in got] if got is not None else [0, 0, 0]
        got = tuple(torch.empty(max(k, h), dtype=d) for k, h, d in zip(need, have, (torch.uint8, torch.int8,
                                                                                       torch.float32)))
        _SCRATCH.bufs = got
    return got


def q8x8_mm(x_MK: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, *, avx2: bool | None = None,
            threads: int | None = None) -> torch.Tensor:
    """``x_MK @ (q·s).T`` [M, N] in x's dtype for an int8 weight [N, K_pad] and its scales [N] (module docstring);
    x's columns past its own count are zeros. ``avx2``: force the AVX2 path (True) or the plain one (False);
    ``threads``: default ``torch.get_num_threads()`` (module docstring, **Threads**)."""
    if not available():
        raise RuntimeError("the q8x8 kernel needs numba (not installed, or EXPERTCACHE_NO_NUMBA is set)")
    n, k_pad = weight.shape
    m, k_in = x_MK.shape
    if weight.dtype != torch.int8 or k_in > k_pad or scales.shape != (n,) or scales.dtype not in _KIND or \
            weight.device.type != "cpu" or not weight.is_contiguous() or not scales.is_contiguous():
        raise ValueError(f"q8x8: x [{m}, {k_in}], weight {tuple(weight.shape)} {weight.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype} do not fit (contiguous CPU int8 [N, K_pad], [N])")
    x = x_MK.detach()
    x = (x if x.dtype in _KIND else x.float()).contiguous()
    y = torch.empty(m, n, dtype=x.dtype)
    xa, xs, sc = _scratch(m, k_pad)
    px, ps, py, kx, ks = x.data_ptr(), scales.data_ptr(), y.data_ptr(), _KIND[x.dtype], _KIND[scales.dtype]
    fn, on_team = _kernel(use_avx2() if avx2 is None else avx2)
    k = team.cut(-(-n // CHUNK), torch.get_num_threads() if threads is None else threads)
    if k == 1:
        fn(px, px, kx, m, k_in, weight.data_ptr(), ps, ps, ks, n, k_pad, py, py, kx, xa.data_ptr(), xs.data_ptr(),
           sc.data_ptr())
    else:  # x quantised here (a product of no rows), then the rows on a team of k threads (team.py), CHUNK at a time
        fn(px, px, kx, m, k_in, weight.data_ptr(), ps, ps, ks, 0, k_pad, py, py, kx, xa.data_ptr(), xs.data_ptr(),
           sc.data_ptr())
        data = np.array([0, px, kx, m, k_in, weight.data_ptr(), ps, ks, n, k_pad, py, kx, xa.data_ptr(), xs.data_ptr(),
                         sc.data_ptr()], np.int64)
        team.run(on_team, data.ctypes.data, k)
    return y if y.dtype == x_MK.dtype else y.to(x_MK.dtype)


def block_sums(x_MK: torch.Tensor, k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq int32 [M, K_pad], block scales float32 [M, K_pad/32 rounded up]): x quantised as the kernel does, in
    torch (the tests' independent computation)."""
    m, k = x_MK.shape
    nb = -(-k_pad // ABLOCK)
    x = torch.nn.functional.pad(x_MK.float(), (0, nb * ABLOCK - k)).view(m, nb, ABLOCK)
    a = x.abs().amax(-1) / 127
    a = torch.where(a > 0, a, torch.ones_like(a))
    xq = torch.round(x / a[..., None]).clamp(-127, 127).to(torch.int32).view(m, -1)[:, :k_pad]
    return xq, a

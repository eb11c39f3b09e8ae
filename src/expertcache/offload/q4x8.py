"""int8 activations × int4 weights for one-token products on the CPU, in numba (the ``q4x8`` expert kernel): what
llama.cpp's Q4 × Q8 dot product does, for the AVX2 x86 CPUs (AMD EPYC / Zen, laptops) where torch's
``_weight_int4pack_mm_for_cpu`` is barely faster than bf16 (``quant.choose_expert_kernel``).

**Layout** (the ``q4x8`` packed layout: ``QuantMatrix.kernel == "q4x8"``, its own sidecar file name): the same
bytes per matrix as torch's CPU int4 layout, so the memory plan, the slots and the reads are unchanged and any
cache size C works (no per-slot copy). The weight is uint8 [N, K/2]: row n's codes in blocks of 32 along K, 16
bytes a block, byte j of a block holding code j in its low nibble and code j + 16 in its high nibble
(:func:`pack_codes`, :func:`unpack_codes`), so one load, one shift and one ``and 0x0F`` give the block's 32 codes in
order. The scales and zeros are [N, K/G, 2] in the compute dtype (bf16, fp16 or fp32): (s, z) of (row, group),
row-major, the order the kernel reads them. Values: ``W[n, k] = (q[n, k] - 8)·s + z`` as in ``offload/quant.py``.

**Product** (:func:`q4x8_mm`), x [M, K'] with K' ≤ K (the missing columns are zeros), one thread: each row of x
is quantised to int8, ``a = max|x| / 127``, ``xq = round(x / a)`` (half to even; a row of zeros gets a = 1, xq =
0), with its integer sums ``Σ xq`` and float sums ``Σ x`` per group; then

    y[m, n] = Σ_g s[n, g]·a·(Σ_{k∈g} q·xq − 8·Σ_{k∈g} xq) + Σ_g z[n, g]·Σ_{k∈g} x_k

The integer dot ``Σ q·xq`` (q u8 in 0..15, xq s8) runs on AVX2's ``vpmaddubsw`` (u8 × s8, pairs summed to int16:
at most 2·15·127 = 3810, and up to 8 blocks of a group, G ≤ 256, added in int16: 30480, no saturation) and one
``vpmaddwd`` by ones per group (int32), summed across the vector once per group (LLVM intrinsics through
``numba.extending.intrinsic``). Where the CPU (or numba's target, ``NUMBA_CPU_NAME``) lacks AVX2, a plain numba
loop computes the same int32 sums (:func:`use_avx2`). Float sums in float32.

**Numerical contract**: the result equals ``(a·xq) @ ((q - 8)·s).T + xs @ z.T`` (xs: the group sums of x) to
float32 rounding; against ``x @ W.T`` with W the dequantised int4 matrix it differs only by the activation's
rounding, at most ``a/2`` per element of x through the ``(q - 8)·s`` part of W.

Compiled on first use (not at import), cached on disk like the project's other loops (:mod:`expertcache.compiled`);
where numba is unavailable (or ``EXPERTCACHE_NO_NUMBA`` is set) :func:`available` is False and the experts keep
torch's int4 kernel.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

import numpy as np
import torch

from expertcache import compiled

__all__ = ["KERNEL", "BLOCK", "available", "use_avx2", "pack_codes", "unpack_codes", "q4x8_mm", "int_dots"]

#: the layout's (and the expert kernel's) name
KERNEL = "q4x8"
#: codes per block: 16 bytes, two nibbles a byte (module docstring)
BLOCK = 32
#: numba target CPUs (``NUMBA_CPU_NAME``) that have AVX2 (LLVM names); "host" and unset mean this CPU
_AVX2_TARGETS = ("haswell", "broadwell", "skylake", "skylake-avx512", "cascadelake", "cooperlake", "cannonlake",
                 "icelake-client", "icelake-server", "tigerlake", "rocketlake", "alderlake", "raptorlake",
                 "meteorlake", "sapphirerapids", "emeraldrapids", "graniterapids", "znver1", "znver2", "znver3",
                 "znver4", "znver5", "x86-64-v3", "x86-64-v4", "core-avx2")


def available() -> bool:
    """Whether the kernel can run here: numba importable and not switched off (``EXPERTCACHE_NO_NUMBA``)."""
    return compiled.AVAILABLE


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def use_avx2() -> bool:
    """Whether the integer dot runs on the AVX2 intrinsics: an x86-64 CPU with the avx2 flag, and numba's target CPU
    (``NUMBA_CPU_NAME``, unset: this one) one with AVX2. Else the plain loop (the same sums)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or "avx2" not in _cpu_flags():
        return False
    target = os.environ.get("NUMBA_CPU_NAME", "").strip().lower()
    return target in ("", "host") or target in _AVX2_TARGETS


def pack_codes(q_NK: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] of the codes ``q_NK`` (integers in 0..15, K % 32 == 0) in the q4x8 layout (module docstring)."""
    n, k = q_NK.shape
    if k % BLOCK:
        raise ValueError(f"q4x8 needs K a multiple of {BLOCK}, got {k}")
    b = q_NK.to(torch.uint8).view(n, k // BLOCK, 2, BLOCK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(w_u8: torch.Tensor) -> torch.Tensor:
    """The codes (uint8 [N, K] in 0..15) of a q4x8 weight (uint8 [N, K/2]): the inverse of :func:`pack_codes`."""
    n, h = w_u8.shape
    b = w_u8.view(n, h // (BLOCK // 2), 1, BLOCK // 2)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(n, 2 * h)


_CFUNCS: dict[bool, object] = {}
_SCRATCH = threading.local()


def _intrinsics():
    """(dot_avx2, dot_plain, scale_f32): the per-group integer dot on AVX2 and plain, and one stored scale as float32
    (defined where numba is; nothing is compiled until a kernel is)."""
    from llvmlite import ir
    import numba
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    v16i8, v32i8, v16i16, v8i32 = (ir.VectorType(i8, 16), ir.VectorType(i8, 32), ir.VectorType(i16, 16),
                                   ir.VectorType(i32, 8))

    def wide(builder, v):
        return builder.sext(v, i64) if v.type != i64 else v

    @intrinsic
    def dot_avx2(typingctx, c, cb, xq, xb, nblk):
        """Σ q·xq over ``nblk`` blocks: codes from byte ``cb`` of ``c`` (uint8, 1-D), xq from ``xb`` of ``xq``
        (int8, 1-D); int32. The blocks' vpmaddubsw pairs are added in int16 (at most 8 blocks: no overflow)."""
        sig = types.int32(c, cb, xq, xb, nblk)

        def codegen(context, builder, signature, args):
            c_v, cb_v, x_v, xb_v, nb_v = args
            ca = context.make_array(signature.args[0])(context, builder, c_v)
            xa = context.make_array(signature.args[2])(context, builder, x_v)
            mod = builder.module
            madd_ub = cgutils.get_or_insert_function(mod, ir.FunctionType(v16i16, [v32i8, v32i8]),
                                                     "llvm.x86.avx2.pmadd.ub.sw")
            madd_wd = cgutils.get_or_insert_function(mod, ir.FunctionType(v8i32, [v16i16, v16i16]),
                                                     "llvm.x86.avx2.pmadd.wd")
            reduce = cgutils.get_or_insert_function(mod, ir.FunctionType(i32, [v8i32]), "llvm.vector.reduce.add.v8i32")
            acc = cgutils.alloca_once_value(builder, ir.Constant(v16i16, [0] * 16))
            cbase, xbase = builder.gep(ca.data, [wide(builder, cb_v)]), builder.gep(xa.data, [wide(builder, xb_v)])
            four, low = ir.Constant(v16i8, [4] * 16), ir.Constant(v32i8, [15] * 32)
            order = ir.Constant(ir.VectorType(i32, 32), list(range(32)))
            with cgutils.for_range(builder, wide(builder, nb_v)) as loop:
                i = loop.index
                cp = builder.gep(cbase, [builder.mul(i, ir.Constant(i.type, 16))])
                v = builder.load(builder.bitcast(cp, v16i8.as_pointer()), align=1)
                w = builder.and_(builder.shuffle_vector(v, builder.lshr(v, four), order), low)
                xp = builder.gep(xbase, [builder.mul(i, ir.Constant(i.type, 32))])
                xv = builder.load(builder.bitcast(xp, v32i8.as_pointer()), align=1)
                builder.store(builder.add(builder.load(acc), builder.call(madd_ub, [w, xv])), acc)
            s = builder.call(madd_wd, [builder.load(acc), ir.Constant(v16i16, [1] * 16)])
            return builder.call(reduce, [s])
        return sig, codegen

    @intrinsic
    def scale_f32(typingctx, arr, idx, kind):
        """Stored scale ``idx`` of ``arr`` (int16, 1-D: the scales' bytes) as float32: ``kind`` 1 bf16, 2 fp16,
        0 float32 (element ``idx`` of the bytes read as float32)."""
        sig = types.float32(arr, idx, kind)

        def codegen(context, builder, signature, args):
            a = context.make_array(signature.args[0])(context, builder, args[0])
            at, k = wide(builder, args[1]), args[2]
            v = builder.load(builder.gep(a.data, [at]))
            bf = builder.bitcast(builder.shl(builder.zext(v, i32), ir.Constant(i32, 16)), f32)
            hf = builder.fpext(builder.bitcast(v, ir.HalfType()), f32)
            ff = builder.load(builder.gep(builder.bitcast(a.data, f32.as_pointer()), [at]))
            one, two = ir.Constant(k.type, 1), ir.Constant(k.type, 2)
            return builder.select(builder.icmp_signed("==", k, one), bf,
                                  builder.select(builder.icmp_signed("==", k, two), hf, ff))
        return sig, codegen

    @numba.njit(inline="always")
    def dot_plain(c, cb, xq, xb, nblk):
        d = np.int32(0)
        for b in range(nblk):
            for j in range(BLOCK // 2):
                byte = np.int32(c[cb + 16 * b + j])
                d += (byte & 15) * np.int32(xq[xb + 32 * b + j]) + (byte >> 4) * np.int32(xq[xb + 32 * b + 16 + j])
        return d

    return dot_avx2, dot_plain, scale_f32


if compiled.AVAILABLE:  # the intrinsics defined (nothing compiled: the kernels compile on first use)
    from numba import carray, njit

    _dot_avx2, _dot_plain, _scale_f32 = _intrinsics()

    @njit(inline="always")
    def _quantise(x, m_rows, k_in, k_pad, group, xq, sxq, xs, scale):
        """Each row of x to int8 (module docstring): xq [M·k_pad] (zeros past k_in), Σ xq and Σ x per group, the
        row's scale a."""
        ng = k_pad // group
        for m in range(m_rows):
            big = np.float32(0.0)
            for k in range(k_in):
                big = max(big, abs(x[m * k_in + k]))
            a = np.float32(big / np.float32(127.0)) if big > 0 else np.float32(1.0)
            scale[m] = a
            for g in range(ng):
                sxq[m * ng + g] = 0
                xs[m * ng + g] = 0
            for k in range(k_pad):
                r = np.int32(0)
                if k < k_in:
                    v = x[m * k_in + k]
                    r = min(127, max(-127, np.int32(np.rint(np.float32(v / a)))))
                    xs[m * ng + k // group] += v
                xq[m * k_pad + k] = r
                sxq[m * ng + k // group] += r

    @njit(inline="always")
    def _arrays(xp, m_rows, k_in, cp, szp, n_rows, k_pad, group, yp, ip, qp, sp, fp):
        ng = k_pad // group
        f = carray(fp, m_rows * (ng + 1))
        return (carray(xp, m_rows * k_in), carray(cp, n_rows * k_pad // 2), carray(szp, n_rows * ng * 4),
                carray(yp, m_rows * n_rows), carray(ip, m_rows * n_rows), carray(qp, m_rows * k_pad),
                carray(sp, m_rows * ng), f[:m_rows * ng], f[m_rows * ng:])

    # the two paths' kernels: the same source but for the dot (module-level functions, so numba caches them)
    def _kernel_avx2(xp, m_rows, k_in, cp, szp, kind, n_rows, k_pad, group, yp, ip, qp, sp, fp):
        x, codes, sz, y, ints, xq, sxq, xs, scale = _arrays(xp, m_rows, k_in, cp, szp, n_rows, k_pad, group, yp, ip,
                                                            qp, sp, fp)
        _quantise(x, m_rows, k_in, k_pad, group, xq, sxq, xs, scale)
        ng, nblk, half = k_pad // group, group // BLOCK, k_pad // 2
        for n in range(n_rows):
            for m in range(m_rows):
                acc, accz = np.float32(0.0), np.float32(0.0)
                for g in range(ng):
                    d = _dot_avx2(codes, n * half + g * (group // 2), xq, m * k_pad + g * group, nblk)
                    if g == 0:
                        ints[m * n_rows + n] = d
                    at = (n * ng + g) * 2
                    acc += _scale_f32(sz, at, kind) * np.float32(d - 8 * sxq[m * ng + g])
                    accz += _scale_f32(sz, at + 1, kind) * xs[m * ng + g]
                y[m * n_rows + n] = scale[m] * acc + accz

    def _kernel_plain(xp, m_rows, k_in, cp, szp, kind, n_rows, k_pad, group, yp, ip, qp, sp, fp):
        x, codes, sz, y, ints, xq, sxq, xs, scale = _arrays(xp, m_rows, k_in, cp, szp, n_rows, k_pad, group, yp, ip,
                                                            qp, sp, fp)
        _quantise(x, m_rows, k_in, k_pad, group, xq, sxq, xs, scale)
        ng, nblk, half = k_pad // group, group // BLOCK, k_pad // 2
        for n in range(n_rows):
            for m in range(m_rows):
                acc, accz = np.float32(0.0), np.float32(0.0)
                for g in range(ng):
                    d = _dot_plain(codes, n * half + g * (group // 2), xq, m * k_pad + g * group, nblk)
                    if g == 0:
                        ints[m * n_rows + n] = d
                    at = (n * ng + g) * 2
                    acc += _scale_f32(sz, at, kind) * np.float32(d - 8 * sxq[m * ng + g])
                    accz += _scale_f32(sz, at + 1, kind) * xs[m * ng + g]
                y[m * n_rows + n] = scale[m] * acc + accz


def _kernel(avx2: bool):
    """The compiled kernel of the AVX2 or the plain path (a C function: numba's cfunc, called through ctypes, which
    costs less per call than a dispatcher's argument unboxing), compiled on first use and cached on disk."""
    got = _CFUNCS.get(avx2)
    if got is None:
        from numba import cfunc, types

        p = types.CPointer
        sig = types.void(p(types.float32), types.int64, types.int64, p(types.uint8), p(types.int16), types.int64,
                         types.int64, types.int64, types.int64, p(types.float32), p(types.int32), p(types.int8),
                         p(types.int32), p(types.float32))
        cf = cfunc(sig, nopython=True, cache=True)(_kernel_avx2 if avx2 else _kernel_plain)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        proto = ctypes.CFUNCTYPE(None, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr)
        got = _CFUNCS.setdefault(avx2, (cf, proto(cf.address)))  # the cfunc kept alive beside its pointer
    return got[1]


_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}


def _scratch(m: int, k_pad: int, ng: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This thread's scratch for M rows (grown, never shrunk): xq int8, group sums int32, float32 group sums + row
    scales."""
    need = (m * k_pad, m * ng, m * (ng + 1))
    got = getattr(_SCRATCH, "bufs", None)
    if got is None or any(t.numel() < k for t, k in zip(got, need)):
        have = [t.numel() for t in got] if got is not None else [0, 0, 0]
        got = tuple(torch.empty(max(k, h), dtype=d) for k, h, d in zip(need, have, (torch.int8, torch.int32,
                                                                                       torch.float32)))
        _SCRATCH.bufs = got
    return got


def _run(x_MK: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int, n: int, avx2: bool | None):
    if not available():
        raise RuntimeError("the q4x8 kernel needs numba (not installed, or EXPERTCACHE_NO_NUMBA is set)")
    n_pad, half = weight.shape
    k_pad = 2 * half
    m, k_in = x_MK.shape
    if k_in > k_pad or k_pad % group or group % BLOCK or group > 8 * BLOCK or n > n_pad or \
            scales.shape != (n_pad, k_pad // group, 2) or scales.dtype not in _KIND or weight.dtype != torch.uint8:
        raise ValueError(f"q4x8: x [{m}, {k_in}], weight {tuple(weight.shape)} {weight.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}, G={group}, n={n} do not fit")
    if weight.device.type != "cpu" or not weight.is_contiguous() or not scales.is_contiguous():
        raise ValueError("q4x8: the weight and scales must be contiguous CPU tensors")
    x = x_MK.detach().to(torch.float32).contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    ints = torch.empty(m, n, dtype=torch.int32)
    xq, sxq, xs = _scratch(m, k_pad, k_pad // group)
    _kernel(use_avx2() if avx2 is None else avx2)(
        x.data_ptr(), m, k_in, weight.data_ptr(), scales.data_ptr(), _KIND[scales.dtype], n, k_pad, group,
        y.data_ptr(), ints.data_ptr(), xq.data_ptr(), sxq.data_ptr(), xs.data_ptr())
    return y, ints


def q4x8_mm(x_MK: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int, n: int | None = None, *,
            avx2: bool | None = None) -> torch.Tensor:
    """``x_MK @ W.T`` [M, n] in x's dtype (module docstring) for a q4x8 weight (uint8 [N, K/2]) and its scales
    [N, K/G, 2]; x's columns past its own count are zeros (K padding); ``n`` (default N): the rows computed (the
    padding rows left out). ``avx2``: force the AVX2 path (True) or the plain one (False); default :func:`use_avx2`."""
    n = weight.shape[0] if n is None else n
    return _run(x_MK, weight, scales, group, n, avx2)[0].to(x_MK.dtype)


def int_dots(x_MK: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int, *, avx2: bool) -> torch.Tensor:
    """int32 [M, N]: the integer sums Σ q·xq of group 0 for every (row of x, row of W), on the chosen path (tests)."""
    return _run(x_MK, weight, scales, group, weight.shape[0], avx2)[1]

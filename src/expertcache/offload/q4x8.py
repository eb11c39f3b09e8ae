"""int8 activations × int4 weights for one-token products on the CPU, in numba (the ``q4x8`` expert kernel): what
llama.cpp's Q4 × Q8 dot product does, for the AVX2 x86 CPUs (AMD EPYC / Zen, laptops) where torch's
``_weight_int4pack_mm_for_cpu`` is barely faster than bf16 (``quant.choose_expert_kernel``); there it is also the
int4 dense part's product (``QuantLinear``, ``quant.dense_int4_kernel``: M rows of a prompt one row at a time, still
1.1-1.2× torch's int4 kernel at M = 16-128 on one AVX2 thread).

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
at most 2·15·127 = 3810; a group's blocks, up to 8 at G = 256, added in int16: 30480, no saturation) and one
``vpmaddwd`` by ones per group (int32), through LLVM intrinsics (``numba.extending.intrinsic``, :func:`_intrinsics`).
The AVX2 path (``rows4_avx2``) computes four output rows at a time: each 32-byte load of x is shared by the four
rows; two blocks of codes come from one 32-byte load (low nibbles: codes j of both, high: codes j + 16), x being
stored in the matching order (in each whole 64 codes the middle two quarters swapped); each row's group sums get
``-8·Σ xq`` added in int32, are converted to float once per group and accumulated with the group's scale in the
row's own float32 vector (four independent FMA chains), summed across once per row; at G = 32 two groups share a
load and a vector of their two scales. The scales are read straight from the slot in their stored dtype (the group
loop is emitted once per dtype); the next row quad's bytes are prefetched. x is read and y written in x's dtype
(float32 sums, rounded once). Where the CPU (or numba's target, ``NUMBA_CPU_NAME``) lacks AVX2, a plain numba loop
computes the same int32 sums (:func:`use_avx2`). The kernels are numba ``cfunc``s called through ctypes (about
8 µs a call from Python, against 10-15 µs through a dispatcher).

**Numerical contract**: the result equals ``(a·xq) @ ((q - 8)·s).T + xs @ z.T`` (xs: the group sums of x) to
float32 rounding; against ``x @ W.T`` with W the dequantised int4 matrix it differs only by the activation's
rounding, at most ``a/2`` per element of x through the ``(q - 8)·s`` part of W.

Compiled on first use (not at import; a run with int4 experts on it compiles it before its memory plan measures the
process: ``preflight.compile_kernels``, :func:`warm`), cached on disk by numba (its own file is its only dependency);
where numba is unavailable (or ``EXPERTCACHE_NO_NUMBA`` is set) :func:`available` is False and the experts keep
torch's int4 kernel.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading

import numpy as np
import torch

from expertcache import compiled

__all__ = ["KERNEL", "BLOCK", "PREFETCH_ROWS", "available", "use_avx2", "warm", "pack_codes", "unpack_codes", "q4x8_mm", "int_dots"]

#: the layout's (and the expert kernel's) name
KERNEL = "q4x8"
#: codes per block: 16 bytes, two nibbles a byte (module docstring)
BLOCK = 32
#: the AVX2 path prefetches the weight bytes this many rows past the four it computes (a hint: no fault past the end)
PREFETCH_ROWS = 4
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


@functools.lru_cache(maxsize=None)
def use_avx2() -> bool:
    """Whether the integer dot runs on the AVX2 intrinsics: an x86-64 CPU with the avx2 flag, and numba's target CPU
    (``NUMBA_CPU_NAME``, unset: this one; numba reads it once, at import) one with AVX2. Else the plain loop (the
    same sums). Read once per process."""
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


_CFUNCS: dict[bool, tuple] = {}
_SCRATCH = threading.local()


def _intrinsics():
    """(dot_avx2, rows4_avx2, scale_f32, store_f32, dot_plain): the per-group integer dot on AVX2 (the tests'
    check), four output rows on AVX2, a stored 16/32-bit float read as float32 and a float32 stored as one, the plain
    per-group dot (defined where numba is; nothing is compiled until a kernel is)."""
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    v16i8, v32i8, v16i16, v8i32, v8f32 = (ir.VectorType(i8, 16), ir.VectorType(i8, 32), ir.VectorType(i16, 16),
                                          ir.VectorType(i32, 8), ir.VectorType(f32, 8))

    def wide(builder, v):
        return builder.sext(v, i64) if v.type != i64 else v

    def fn(builder, name, ret, *args):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(args)), name)

    def group_sums(builder, cbase, xbase, nblk, acc):
        """The int16 pair sums (vpmaddubsw) of ``nblk`` blocks from byte pointers ``cbase`` (codes), ``xbase`` (xq)
        added into the <16 x i16> at ``acc`` (zeroed here); returns their <8 x i32> (vpmaddwd by ones)."""
        madd_ub = fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, v32i8, v32i8)
        madd_wd = fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, v16i16, v16i16)
        four, low = ir.Constant(v16i8, [4] * 16), ir.Constant(v32i8, [15] * 32)
        order = ir.Constant(ir.VectorType(i32, 32), list(range(32)))
        builder.store(ir.Constant(v16i16, [0] * 16), acc)
        with cgutils.for_range(builder, nblk) as loop:
            i = loop.index
            cp = builder.gep(cbase, [builder.mul(i, ir.Constant(i.type, 16))])
            v = builder.load(builder.bitcast(cp, v16i8.as_pointer()), align=1)
            w = builder.and_(builder.shuffle_vector(v, builder.lshr(v, four), order), low)  # codes j, j + 16
            xp = builder.gep(xbase, [builder.mul(i, ir.Constant(i.type, 32))])
            xv = builder.load(builder.bitcast(xp, v32i8.as_pointer()), align=1)
            builder.store(builder.add(builder.load(acc), builder.call(madd_ub, [w, xv])), acc)
        return builder.call(madd_wd, [builder.load(acc), ir.Constant(v16i16, [1] * 16)])

    def load_scale(builder, p16, p32, at, kind):
        """Stored scale ``at`` as float32: float32 (kind 0) from ``p32``, bf16 (1) or fp16 (2) bits from ``p16``;
        each read only where its kind is (no load past the scales' bytes)."""
        with builder.if_else(builder.icmp_signed("==", kind, ir.Constant(kind.type, 0))) as (as32, as16):
            with as32:
                b32 = builder.basic_block
                v32 = builder.load(builder.gep(p32, [at]))
            with as16:
                b16 = builder.basic_block
                v = builder.load(builder.gep(p16, [at]))
                bf = builder.bitcast(builder.shl(builder.zext(v, i32), ir.Constant(i32, 16)), f32)
                hf = builder.fpext(builder.bitcast(v, ir.HalfType()), f32)
                v16 = builder.select(builder.icmp_signed("==", kind, ir.Constant(kind.type, 1)), bf, hf)
        out = builder.phi(f32)
        out.add_incoming(v32, b32)
        out.add_incoming(v16, b16)
        return out

    def scale_at(builder, p16, at, kind):
        """Stored scale ``at`` (an index into the scales as the kind stores them) as float32, ``kind`` known here."""
        if kind == 0:
            return builder.load(builder.gep(builder.bitcast(p16, f32.as_pointer()), [at]))
        v = builder.load(builder.gep(p16, [at]))
        if kind == 1:
            return builder.bitcast(builder.shl(builder.zext(v, i32), ir.Constant(i32, 16)), f32)
        return builder.fpext(builder.bitcast(v, ir.HalfType()), f32)

    def ptr(context, builder, ty, val, at):
        return builder.gep(context.make_array(ty)(context, builder, val).data, [wide(builder, at)])

    @intrinsic
    def dot_avx2(typingctx, c, cb, xq, xb, nblk):
        """Σ q·xq over ``nblk`` blocks: codes from byte ``cb`` of ``c`` (uint8, 1-D), xq from ``xb`` of ``xq``
        (int8, 1-D); int32. The blocks' vpmaddubsw pairs are added in int16 (at most 8 blocks: no overflow)."""
        def codegen(context, builder, sig, args):
            acc = cgutils.alloca_once(builder, v16i16)
            s = group_sums(builder, ptr(context, builder, sig.args[0], args[0], args[1]),
                           ptr(context, builder, sig.args[2], args[2], args[3]), wide(builder, args[4]), acc)
            return builder.call(fn(builder, "llvm.vector.reduce.add.v8i32", i32, v8i32), [s])
        return types.int32(c, cb, xq, xb, nblk), codegen

    @intrinsic
    def rows4_avx2(typingctx, c, cb, half, xq, xb, sz, sb, kind, corr, cob, xs, xsb, a, ng, nblk, out, ob):
        """Four outputs y[n0..n0+3] of one row of x (float32, stored at ``out[ob..ob+3]``): codes of row n0 from
        byte ``cb`` of ``c`` (rows ``half`` bytes apart), xq from ``xb``; the four rows' (s, z) per group from
        element ``sb`` of ``sz`` (the scales' bytes as int16) stored as ``kind`` (0 float32, 1 bf16, 2 fp16: the
        group loop is emitted once per kind, chosen once); ``corr`` the int32 [ng, 8] vectors added to each group's sums (``-8·Σ xq`` in lane 0)
        from ``cob``; ``xs`` the float group sums of x from ``xsb``; ``a`` x's scale. Per group: each block's 32 xq
        loaded once for the four rows; each row's int32 sums converted once and accumulated with its scale in its
        own float32 vector (four independent chains), its zero term in its own float; summed across at the end."""
        def codegen(context, builder, sig, args):
            c_v, cb_v, half_v, x_v, xb_v, sz_v, sb_v, kind_v, corr_v, cob_v, xs_v, xsb_v, a_v, ng_v, nb_v, out_v, ob_v = args
            cbase = ptr(context, builder, sig.args[0], c_v, cb_v)
            xbase = ptr(context, builder, sig.args[3], x_v, xb_v)
            s16 = context.make_array(sig.args[5])(context, builder, sz_v).data
            sb = wide(builder, sb_v)
            cop = builder.bitcast(ptr(context, builder, sig.args[8], corr_v, cob_v), v8i32.as_pointer())
            xsp = ptr(context, builder, sig.args[10], xs_v, xsb_v)
            outp = ptr(context, builder, sig.args[15], out_v, ob_v)
            half, ng, nblk = wide(builder, half_v), wide(builder, ng_v), wide(builder, nb_v)
            madd_ub = fn(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, v32i8, v32i8)
            madd_wd = fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, v16i16, v16i16)
            four, low = ir.Constant(v16i8, [4] * 16), ir.Constant(v32i8, [15] * 32)
            order = ir.Constant(ir.VectorType(i32, 32), list(range(32)))
            accs = [cgutils.alloca_once(builder, v16i16) for _ in range(4)]
            faccs = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, [0.0] * 8)) for _ in range(4)]
            zaccs = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(4)]
            rows = [builder.gep(cbase, [builder.mul(half, ir.Constant(i64, r))]) for r in range(4)]
            gbytes, gcodes = builder.mul(nblk, ir.Constant(i64, 16)), builder.mul(nblk, ir.Constant(i64, 32))
            fma8 = fn(builder, "llvm.fmuladd.v8f32", v8f32, v8f32, v8f32, v8f32)  # fused where the CPU has FMA
            fma1 = fn(builder, "llvm.fmuladd.f32", f32, f32, f32, f32)
            prefetch = fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), i8.as_pointer(), i32, i32, i32)
            ahead = builder.mul(half, ir.Constant(i64, 4 + PREFETCH_ROWS))  # the same place of a later quad's rows
            def group_loop(kind, first, count):
                """Groups [first, first + count), one at a time (G >= 64: blocks two at a time)."""
                with cgutils.for_range(builder, count) as gl:
                    g = builder.add(first, gl.index)
                    for acc in accs:
                        builder.store(ir.Constant(v16i16, [0] * 16), acc)
                    for row in rows:  # weights stream from memory: fetch the rows ahead of their use
                        pf = builder.gep(row, [builder.add(ahead, builder.mul(g, gbytes))])
                        builder.call(prefetch, [pf, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                    pairs = builder.icmp_signed("==", builder.and_(nblk, ir.Constant(i64, 1)), ir.Constant(i64, 0))
                    with builder.if_else(pairs) as (two, one):
                        with two:  # blocks two at a time: one 32-byte load a row (xq in the pair order: _quantise)
                            with cgutils.for_range(builder, builder.lshr(nblk, ir.Constant(i64, 1))) as bl:
                                b = bl.index
                                xp = builder.gep(xbase, [builder.add(builder.mul(g, gcodes),
                                                                     builder.mul(b, ir.Constant(i64, 64)))])
                                x_lo = builder.load(builder.bitcast(xp, v32i8.as_pointer()), align=1)
                                x_hi = builder.load(builder.bitcast(builder.gep(xp, [ir.Constant(i64, 32)]),
                                                                    v32i8.as_pointer()), align=1)
                                at = builder.add(builder.mul(g, gbytes), builder.mul(b, ir.Constant(i64, 32)))
                                for row, acc in zip(rows, accs):
                                    v = builder.load(builder.bitcast(builder.gep(row, [at]), v32i8.as_pointer()), align=1)
                                    lo = builder.and_(v, low)
                                    hi = builder.and_(builder.lshr(v, ir.Constant(v32i8, [4] * 32)), low)
                                    both = builder.add(builder.call(madd_ub, [lo, x_lo]), builder.call(madd_ub, [hi, x_hi]))
                                    builder.store(builder.add(builder.load(acc), both), acc)
                        with one:  # one block at a time: codes j and j + 16 of a 16-byte load
                            with cgutils.for_range(builder, nblk) as bl:
                                b = bl.index
                                xp = builder.gep(xbase, [builder.add(builder.mul(g, gcodes),
                                                                     builder.mul(b, ir.Constant(i64, 32)))])
                                xv = builder.load(builder.bitcast(xp, v32i8.as_pointer()), align=1)
                                at = builder.add(builder.mul(g, gbytes), builder.mul(b, ir.Constant(i64, 16)))
                                for row, acc in zip(rows, accs):
                                    v = builder.load(builder.bitcast(builder.gep(row, [at]), v16i8.as_pointer()), align=1)
                                    w = builder.and_(builder.shuffle_vector(v, builder.lshr(v, four), order), low)
                                    builder.store(builder.add(builder.load(acc), builder.call(madd_ub, [w, xv])), acc)
                    cv = builder.load(builder.gep(cop, [g]), align=4)
                    xsg = builder.load(builder.gep(xsp, [g]))
                    for r in range(4):
                        si = builder.add(sb, builder.mul(builder.add(builder.mul(ir.Constant(i64, r), ng), g),
                                                         ir.Constant(i64, 2)))
                        sc, zc = (scale_at(builder, s16, builder.add(si, ir.Constant(i64, j)), kind) for j in (0, 1))
                        p32 = builder.add(builder.call(madd_wd, [builder.load(accs[r]), ir.Constant(v16i16, [1] * 16)]), cv)
                        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(v8f32, None), sc,
                                                                              ir.Constant(i32, 0)),
                                                       ir.Constant(v8f32, None), ir.Constant(v8i32, [0] * 8))
                        builder.store(builder.call(fma8, [builder.sitofp(p32, v8f32), splat, builder.load(faccs[r])]),
                                      faccs[r])
                        builder.store(builder.call(fma1, [zc, xsg, builder.load(zaccs[r])]), zaccs[r])

            def pair_loop(kind):
                """G = 32: groups two at a time, one 32-byte load a row (xq in the pair order): each 128-bit half
                of the sums is one group's, scaled by its own scale (a vector of two scales)."""
                two = ir.Constant(i64, 2)
                with cgutils.for_range(builder, builder.lshr(ng, ir.Constant(i64, 1))) as gl:
                    g = builder.mul(gl.index, two)
                    at = builder.mul(g, ir.Constant(i64, 16))
                    for row in rows:
                        pf = builder.gep(row, [builder.add(ahead, at)])
                        builder.call(prefetch, [pf, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                    xp = builder.gep(xbase, [builder.mul(g, ir.Constant(i64, 32))])
                    x_lo = builder.load(builder.bitcast(xp, v32i8.as_pointer()), align=1)
                    x_hi = builder.load(builder.bitcast(builder.gep(xp, [ir.Constant(i64, 32)]), v32i8.as_pointer()),
                                        align=1)
                    cv = builder.shuffle_vector(builder.load(builder.gep(cop, [g]), align=4),
                                                builder.load(builder.gep(cop, [builder.add(g, ir.Constant(i64, 1))]),
                                                             align=4),
                                                ir.Constant(v8i32, [0, 1, 2, 3, 8, 9, 10, 11]))
                    xs0 = builder.load(builder.gep(xsp, [g]))
                    xs1 = builder.load(builder.gep(xsp, [builder.add(g, ir.Constant(i64, 1))]))
                    v2f32 = ir.VectorType(f32, 2)
                    for r, row in enumerate(rows):
                        v = builder.load(builder.bitcast(builder.gep(row, [at]), v32i8.as_pointer()), align=1)
                        lo = builder.and_(v, low)
                        hi = builder.and_(builder.lshr(v, ir.Constant(v32i8, [4] * 32)), low)
                        both = builder.add(builder.call(madd_ub, [lo, x_lo]), builder.call(madd_ub, [hi, x_hi]))
                        p32 = builder.add(builder.call(madd_wd, [both, ir.Constant(v16i16, [1] * 16)]), cv)
                        si = builder.add(sb, builder.mul(builder.add(builder.mul(ir.Constant(i64, r), ng), g), two))
                        s0, z0, s1, z1 = (scale_at(builder, s16, builder.add(si, ir.Constant(i64, j)), kind)
                                          for j in range(4))
                        sv = builder.insert_element(builder.insert_element(ir.Constant(v2f32, None), s0,
                                                                           ir.Constant(i32, 0)), s1, ir.Constant(i32, 1))
                        sv = builder.shuffle_vector(sv, ir.Constant(v2f32, None),
                                                    ir.Constant(v8i32, [0, 0, 0, 0, 1, 1, 1, 1]))
                        builder.store(builder.call(fma8, [builder.sitofp(p32, v8f32), sv, builder.load(faccs[r])]),
                                      faccs[r])
                        z = builder.call(fma1, [z0, xs0, builder.load(zaccs[r])])
                        builder.store(builder.call(fma1, [z1, xs1, z]), zaccs[r])

            g32 = builder.icmp_signed("==", nblk, ir.Constant(i64, 1))
            odd = builder.and_(ng, ir.Constant(i64, 1))
            kinds = builder.switch(kind_v, builder.append_basic_block("kind_end"))
            after = kinds.default
            for k in (0, 1, 2):
                blk = builder.append_basic_block(f"kind{k}")
                kinds.add_case(ir.Constant(kind_v.type, k), blk)
                builder.position_at_end(blk)
                with builder.if_else(g32) as (by_pairs, by_groups):
                    with by_pairs:  # pairs of groups, then the last group alone where their count is odd
                        pair_loop(k)
                        group_loop(k, builder.sub(ng, odd), odd)
                    with by_groups:
                        group_loop(k, ir.Constant(i64, 0), ng)
                builder.branch(after)
            builder.position_at_end(after)
            red = fn(builder, "llvm.vector.reduce.fadd.v8f32", f32, f32, v8f32)
            for r in range(4):
                tot = builder.call(red, [ir.Constant(f32, 0.0), builder.load(faccs[r])])
                builder.store(builder.fadd(builder.fmul(a_v, tot), builder.load(zaccs[r])),
                              builder.gep(outp, [ir.Constant(i64, r)]))
            return context.get_dummy_value()
        return types.none(c, cb, half, xq, xb, sz, sb, kind, corr, cob, xs, xsb, a, ng, nblk, out, ob), codegen

    @intrinsic
    def scale_f32(typingctx, sz16, sz32, at, kind):
        """Stored scale ``at`` (the scales' bytes as int16 and as float32 arrays) as float32 (``load_scale``)."""
        def codegen(context, builder, sig, args):
            return load_scale(builder, context.make_array(sig.args[0])(context, builder, args[0]).data,
                              context.make_array(sig.args[1])(context, builder, args[1]).data, wide(builder, args[2]),
                              args[3])
        return types.float32(sz16, sz32, at, kind), codegen

    @intrinsic
    def store_f32(typingctx, y16, y32, at, val, kind):
        """Store float32 ``val`` at ``at`` as ``kind``: float32 into ``y32``, bf16 (round to nearest even, as torch
        converts) or fp16 into ``y16``; only the kind's array is written."""
        def codegen(context, builder, sig, args):
            p16 = context.make_array(sig.args[0])(context, builder, args[0]).data
            p32 = context.make_array(sig.args[1])(context, builder, args[1]).data
            at, val, kind = wide(builder, args[2]), args[3], args[4]
            with builder.if_else(builder.icmp_signed("==", kind, ir.Constant(kind.type, 0))) as (as32, as16):
                with as32:
                    builder.store(val, builder.gep(p32, [at]))
                with as16:
                    bits = builder.bitcast(val, i32)
                    odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
                    rounded = builder.add(bits, builder.add(ir.Constant(i32, 0x7FFF), odd))
                    bf = builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), i16)
                    hf = builder.bitcast(builder.fptrunc(val, ir.HalfType()), i16)
                    one = builder.icmp_signed("==", kind, ir.Constant(kind.type, 1))
                    builder.store(builder.select(one, bf, hf), builder.gep(p16, [at]))
            return context.get_dummy_value()
        return types.none(y16, y32, at, val, kind), codegen

    @numba.njit(inline="always")
    def dot_plain(c, cb, xq, xb, nblk):
        d = np.int32(0)
        for b in range(nblk):
            for j in range(BLOCK // 2):
                byte = np.int32(c[cb + 16 * b + j])
                d += (byte & 15) * np.int32(xq[xb + 32 * b + j]) + (byte >> 4) * np.int32(xq[xb + 32 * b + 16 + j])
        return d

    return dot_avx2, rows4_avx2, scale_f32, store_f32, dot_plain


if compiled.AVAILABLE:  # the intrinsics defined (nothing compiled: the kernels compile on first use)
    from numba import carray, njit

    _dot_avx2, _rows4_avx2, _scale_f32, _store_f32, _dot_plain = _intrinsics()

    @njit(inline="always")
    def _quantise(x16, x32, xkind, m_rows, k_in, k_pad, group, xq, sxq, xs, scale, pairs):
        """Each row of x to int8 (module docstring): xq [M·k_pad] (zeros past k_in), Σ xq and Σ x per group, the
        row's scale a; x stored as ``xkind`` (``x16``/``x32``: its bytes as int16 / float32, :func:`scale_f32`). ``pairs``: xq in the order of rows4_avx2's two-block loads (in each whole 64 codes the middle two
        quarters swapped: a 32-byte load of two blocks gives their codes j in its low nibbles, j + 16 in its high)."""
        ng = k_pad // group
        for m in range(m_rows):
            big = np.float32(0.0)
            for k in range(k_in):
                big = max(big, abs(_scale_f32(x16, x32, m * k_in + k, xkind)))
            a = np.float32(big / np.float32(127.0)) if big > 0 else np.float32(1.0)
            scale[m] = a
            for g in range(ng):
                sxq[m * ng + g] = 0
                xs[m * ng + g] = 0
            for k in range(k_pad):
                r = np.int32(0)
                if k < k_in:
                    v = _scale_f32(x16, x32, m * k_in + k, xkind)
                    r = min(127, max(-127, np.int32(np.rint(np.float32(v / a)))))
                    xs[m * ng + k // group] += v
                i = k & 63
                at = k
                if pairs and k < k_pad - k_pad % 64:  # whole 64-code chunks only (a last 32 stay in order)
                    at = k + (16 if i >= 16 and i < 32 else -16 if i >= 32 and i < 48 else 0)
                xq[m * k_pad + at] = r
                sxq[m * ng + k // group] += r

    @njit(inline="always")
    def _arrays(xp, xf, m_rows, k_in, cp, szp, szf, n_rows, k_pad, group, yp, yf, qp, sp, fp):
        ng = k_pad // group
        f = carray(fp, m_rows * (ng + 1))
        return (carray(xp, m_rows * k_in), carray(xf, m_rows * k_in), carray(cp, n_rows * k_pad // 2),
                carray(szp, n_rows * ng * 2), carray(szf, n_rows * ng * 2), carray(yp, m_rows * n_rows),
                carray(yf, m_rows * n_rows), carray(qp, m_rows * k_pad), carray(sp, m_rows * ng), f[:m_rows * ng],
                f[m_rows * ng:])

    @njit(inline="always")
    def _offsets(sz16, sz32, kind, n, m, sxq, xs, ng):
        """Σ_g s_g·(-8·Σ xq) and Σ_g z_g·Σ x of output (m, n): the code offset and the zero terms."""
        off, zero = np.float32(0.0), np.float32(0.0)
        for g in range(ng):
            at = (n * ng + g) * 2
            off += _scale_f32(sz16, sz32, at, kind) * np.float32(-8 * sxq[m * ng + g])
            zero += _scale_f32(sz16, sz32, at + 1, kind) * xs[m * ng + g]
        return off, zero

    # the two paths' kernels (module-level functions, so numba caches them): the AVX2 one on row_avx2, the plain
    # one on dot_plain
    def _kernel_avx2(xp, xf, xkind, m_rows, k_in, cp, szp, szf, kind, n_rows, k_pad, group, yp, yf, ykind, qp, sp,
                     fp):
        """y [M, n_rows] (n_rows a multiple of 4: rows of four at a time on rows4_avx2)."""
        n4 = n_rows
        x16, x32, codes, sz16, sz32, y16, y32, xq, sxq, xs, scale = _arrays(xp, xf, m_rows, k_in, cp, szp, szf, n4,
                                                                            k_pad, group, yp, yf, qp, sp, fp)
        _quantise(x16, x32, xkind, m_rows, k_in, k_pad, group, xq, sxq, xs, scale, True)
        four = np.empty(4, dtype=np.float32)
        ng, nblk, half = k_pad // group, group // BLOCK, k_pad // 2
        corr = np.zeros(m_rows * ng * 8, dtype=np.int32)
        for j in range(m_rows * ng):
            corr[8 * j] = -8 * sxq[j]
        for n0 in range(0, n4, 4):
            for m in range(m_rows):
                _rows4_avx2(codes, n0 * half, half, xq, m * k_pad, sz16, n0 * ng * 2, kind, corr, m * ng * 8, xs,
                            m * ng, scale[m], ng, nblk, four, 0)
                for r in range(4):
                    _store_f32(y16, y32, m * n4 + n0 + r, four[r], ykind)

    def _kernel_plain(xp, xf, xkind, m_rows, k_in, cp, szp, szf, kind, n_rows, k_pad, group, yp, yf, ykind, qp, sp,
                      fp):
        x16, x32, codes, sz16, sz32, y16, y32, xq, sxq, xs, scale = _arrays(xp, xf, m_rows, k_in, cp, szp, szf,
                                                                            n_rows, k_pad, group, yp, yf, qp, sp, fp)
        _quantise(x16, x32, xkind, m_rows, k_in, k_pad, group, xq, sxq, xs, scale, False)
        ng, nblk, half = k_pad // group, group // BLOCK, k_pad // 2
        for n in range(n_rows):
            for m in range(m_rows):
                off, zero = _offsets(sz16, sz32, kind, n, m, sxq, xs, ng)
                main = np.float32(0.0)
                for g in range(ng):
                    d = _dot_plain(codes, n * half + g * (group // 2), xq, m * k_pad + g * group, nblk)
                    main += _scale_f32(sz16, sz32, (n * ng + g) * 2, kind) * np.float32(d)
                _store_f32(y16, y32, m * n_rows + n, scale[m] * (main + off) + zero, ykind)

    # two loops, not one with a flag: a function calling the AVX2 intrinsic must never be compiled where it is missing
    @compiled.jit
    def _dots_avx2(codes, xq, n_rows, m_rows, k_pad, group, out):
        ng, nblk, half = k_pad // group, group // BLOCK, k_pad // 2
        for m in range(m_rows):
            for n in range(n_rows):
                for g in range(ng):
                    out[(m * n_rows + n) * ng + g] = _dot_avx2(codes, n * half + g * (group // 2), xq,
                                                               m * k_pad + g * group, nblk)

    @compiled.jit
    def _dots_plain(codes, xq, n_rows, m_rows, k_pad, group, out):
        ng, nblk, half = k_pad // group, group // BLOCK, k_pad // 2
        for m in range(m_rows):
            for n in range(n_rows):
                for g in range(ng):
                    out[(m * n_rows + n) * ng + g] = _dot_plain(codes, n * half + g * (group // 2), xq,
                                                                m * k_pad + g * group, nblk)


def _kernel(avx2: bool):
    """The compiled kernel of the AVX2 or the plain path (a C function: numba's cfunc, called through ctypes, which
    costs less per call than a dispatcher's argument unboxing), compiled on first use and cached on disk."""
    got = _CFUNCS.get(avx2)
    if got is None:
        from numba import cfunc, types

        p = types.CPointer
        i64, f32, i16 = types.int64, types.float32, types.int16
        sig = types.void(p(i16), p(f32), i64, i64, i64, p(types.uint8), p(i16), p(f32), i64, i64, i64, i64, p(i16),
                         p(f32), i64, p(types.int8), p(types.int32), p(f32))
        body = _kernel_avx2 if avx2 else _kernel_plain
        try:
            cf = cfunc(sig, nopython=True, cache=True)(body)
        except RuntimeError:  # no writable cache location (a read-only install, no user cache dir): per process
            cf = cfunc(sig, nopython=True)(body)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        proto = ctypes.CFUNCTYPE(None, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr,
                                 ptr, ptr)
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


def warm() -> None:
    """Compile (or load from numba's cache) the kernel of this CPU's path now (``preflight.compile_kernels``: before
    the memory plan measures the process), not at the first product."""
    _kernel(use_avx2())


def _check(x_MK, weight, scales, group, n):
    if not available():
        raise RuntimeError("the q4x8 kernel needs numba (not installed, or EXPERTCACHE_NO_NUMBA is set)")
    n_pad, half = weight.shape
    k_pad = 2 * half
    m, k_in = x_MK.shape
    if k_in > k_pad or k_pad % group or group % BLOCK or group > 8 * BLOCK or n > n_pad or n_pad % 4 or \
            scales.shape != (n_pad, k_pad // group, 2) or scales.dtype not in _KIND or weight.dtype != torch.uint8:
        raise ValueError(f"q4x8: x [{m}, {k_in}], weight {tuple(weight.shape)} {weight.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}, G={group}, n={n} do not fit")
    if weight.device.type != "cpu" or not weight.is_contiguous() or not scales.is_contiguous():
        raise ValueError("q4x8: the weight and scales must be contiguous CPU tensors")
    return m, k_in, k_pad


def q4x8_mm(x_MK: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int, n: int | None = None, *,
            avx2: bool | None = None) -> torch.Tensor:
    """``x_MK @ W.T`` [M, n] in x's dtype (module docstring) for a q4x8 weight (uint8 [N, K/2]) and its scales
    [N, K/G, 2]; x's columns past its own count are zeros (K padding); ``n`` (default N): the rows computed (the
    padding rows left out). ``avx2``: force the AVX2 path (True) or the plain one (False); default :func:`use_avx2`."""
    n = weight.shape[0] if n is None else n
    m, k_in, k_pad = _check(x_MK, weight, scales, group, n)
    x = x_MK.detach()
    if x.dtype not in _KIND:
        x = x.float()
    x = x.contiguous()
    n4 = -(-n // 4) * 4  # rows of four (the weight's rows are a multiple of 4)
    y = torch.empty(m, n4, dtype=x.dtype)  # written in x's dtype by the kernel (float32 sums, rounded once)
    xq, sxq, xs = _scratch(m, k_pad, k_pad // group)
    p, px, py = scales.data_ptr(), x.data_ptr(), y.data_ptr()
    _kernel(use_avx2() if avx2 is None else avx2)(px, px, _KIND[x.dtype], m, k_in, weight.data_ptr(), p, p,
                                                  _KIND[scales.dtype], n4, k_pad, group, py, py, _KIND[x.dtype],
                                                  xq.data_ptr(), sxq.data_ptr(), xs.data_ptr())
    y = y if n4 == n else y[:, :n].contiguous()
    return y if y.dtype == x_MK.dtype else y.to(x_MK.dtype)


def int_dots(x_MK: torch.Tensor, weight: torch.Tensor, group: int, *, avx2: bool) -> torch.Tensor:
    """int32 [M, N, K/G]: the integer sums Σ q·xq per group of every (row of x, row of W), x quantised as the kernel
    does (module docstring), on the chosen path (for the tests: the two paths agree exactly)."""
    n_pad, half = weight.shape
    m, k = x_MK.shape
    a = x_MK.float().abs().amax(1, keepdim=True) / 127
    xq = torch.round(x_MK.float() / torch.where(a > 0, a, torch.ones_like(a))).clamp(-127, 127)
    xq = torch.nn.functional.pad(xq, (0, 2 * half - k)).to(torch.int8).reshape(-1)
    out = torch.empty(m * n_pad * (2 * half // group), dtype=torch.int32)
    (_dots_avx2 if avx2 else _dots_plain)(weight.reshape(-1).numpy(), xq.numpy(), n_pad, m, 2 * half, group,
                                          out.numpy())
    return out.view(m, n_pad, -1)

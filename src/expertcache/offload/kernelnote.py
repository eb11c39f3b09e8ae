"""The kernel-choice line (stderr at a quantised start on the CPU, and every benchmark row): the CPU, its ISA flags
and caps, and the kernel each quantised part runs on, from the choices of :mod:`expertcache.offload.quant`
(experts, int4 dense part) and :func:`expertcache.offload.qlinear.int8_kernel` (int8 dense part)."""

from __future__ import annotations

import sys

from expertcache.offload import q4x8
from expertcache.offload import quant as q
from expertcache.offload.qlinear import int8_kernel

__all__ = ["kernel_choice_line", "say_kernels"]


def _int8_name(weight_only: bool, compiled: bool, act: str) -> str:
    k = int8_kernel(compiled=compiled, weight_only=weight_only)
    if k == "q8x8":
        return (f"q8x8 (numba, int8 activations per 32 values × int8, "
                f"{'AVX2 vpmaddubsw' if q4x8.use_avx2() else 'plain loop: no AVX2 here'}; offload/q8x8.py)")
    return f"quantized.linear_dynamic (FBGEMM, {act} activations per token)" if k == "fbgemm" else "_weight_int8pack_mm"


def kernel_choice_line(experts: str | None, dense: str | None, *, compiled: bool = False, norms: int = 0) -> str:
    """One line for stderr and the bench rows: the CPU, its ISA, and the kernel each quantised part runs on;
    ``norms``: how many RMSNorms run on the host norm (``OffloadedModel.host_norms``, offload/hostnorm.py)."""
    c = q.cpu_description()
    names = {"int4": "_weight_int4pack_mm_for_cpu", "int8": "_weight_int8pack_mm"}
    act = "8-bit" if q.fbgemm_vnni() else "7-bit"
    dk = {"int4": (f"q4x8 (numba, int8 activations per token × int4, "
                   f"{'AVX2 vpmaddubsw' if q4x8.use_avx2() else 'plain loop: no AVX2 here'}; offload/q4x8.py)")
          if q.dense_int4_kernel(compiled=compiled) == q4x8.KERNEL else names["int4"], "int8": _int8_name(False, compiled, act)}
    ek = dict(names)
    if q.expert_kernel(experts) == "q4x8":
        ek["int4"] = (f"q4x8 (numba, int8 activations per token × int4, "
                      f"{'AVX2 vpmaddubsw' if q4x8.use_avx2() else 'plain loop: no AVX2 here'}; offload/q4x8.py)")
    elif q.expert_kernel(experts) == "fbgemm":
        ek["int4"] = (f"where every expert is resident (C = N) re-quantised per slot to int8 per channel on "
                      f"quantized.linear_dynamic (FBGEMM, {act} activations per token), else {names['int4']}")
    timed = q.PROBED.get(c["aten_capability"]) if q.expert_kernel(experts, probed=False) == "fbgemm" else None
    if timed:  # FBGEMM offered here and timed against torch's int4 kernel (fbexperts.slot_kernel)
        ek["int4"] += (f" (timed here, one token x gate_up: int4pack {timed[1]['int4pack'] * 1e6:.0f} us, FBGEMM "
                       f"{timed[1]['fbgemm'] * 1e6:.0f} us; FBGEMM taken where 2x faster)")
    dk["int4-head8"] = f"(attention {dk['int4']}, lm_head int8 {_int8_name(True, compiled, act)}, embedding int4 rows)"
    caps = "".join(f" {k}={v}" for k, v in c["isa_env"].items())
    slow = not timed and q.expert_kernel(experts) == "int4pack" and \
        c["aten_capability"] not in ("AVX512", "AVX512_BF16", "AVX512_VNNI")
    note = (" (on an AVX2 AMD EPYC torch's int4 kernel measured 0.74-0.97x bf16 per matrix: int4 experts may save "
            "memory and reads there, not compute; BENCHMARKS.md \"Which 4-bit kernel on which CPU\")") if slow else ""
    return (f"kernels on {c['cpu']} [{' '.join(c['cpu_flags']) or 'no SIMD flags read'}], ATen {c['aten_capability']}"
            f"{caps}: experts {experts and f'{experts} {ek[experts]}' or 'bf16'}; dense part "
            f"{dense and f'{dense} {dk[dense]}' or 'bf16'}"
            f"{f'; RMSNorm ×{norms} one numba call each (offload/hostnorm.py)' if norms else ''}{note}")


def say_kernels(experts: str | None, dense: str | None, *, compiled: bool = False, norms: int = 0) -> None:
    """:func:`kernel_choice_line` on stderr, once per quantised start on the CPU."""
    print(f"expertcache: {kernel_choice_line(experts, dense, compiled=compiled, norms=norms)}", file=sys.stderr)

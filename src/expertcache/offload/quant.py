"""Weight-only quantisation in the layouts of torch's fused kernels: int8 (per output channel) and int4
(group-wise, asymmetric), for the experts (one packed blob per expert) and the dense weights (:mod:`qlinear`).

Torch's own ops rather than torchao: torchao's weight-only int4/int8 paths call these same aten ops through
tensor subclasses that quantise an ``nn.Linear`` in memory; an offloaded expert is a flat byte blob read from
disk into a slot, so what is needed is the kernel's packed bytes at known offsets (views of the slot, no
subclass, no copy), and torchao pins torch versions. A weight is packed once, when it is written; every use is
one kernel call (STYLE.md "quantised weights are computed, not unpacked").

Kernel contracts (torch 2.13; pinned by ``tests/test_quant_kernels.py`` against a plain dequantisation):

- **int4, CPU**: ``_convert_weight_to_int4pack_for_cpu(q int32 [N, K] in 0..15, innerKTiles)`` -> uint8
  [N, K/2]; ``_weight_int4pack_mm_for_cpu(x [M, K], packed, G, sz [K/G, N, 2])`` = ``x @ W.T`` with
  ``W[n, k] = (q[n, k] - 8) * s + z``, ``(s, z) = sz[k // G, n]``; x and sz of one float dtype (bf16, fp16,
  fp32); G in {32, 64, 128, 256}; K % G == 0; N % 16 == 0. The packed bytes are a permutation that depends on
  the CPU's vector width (different for AVX512, AVX2 and none: ``torch.backends.cpu.get_cpu_capability()``),
  so the layout is named for it (:func:`kernel_for`) and a sidecar packed for another capability is rebuilt.
- **int4, CUDA** (tinygemm): ``_convert_weight_to_int4pack(u8 [N, K/2], high nibble first, innerKTiles)`` ->
  int32 [N/8, K/(16·innerKTiles), 32, innerKTiles/2] (CUDA only: a CUDA sidecar is packed on the device);
  ``_weight_int4pack_mm(x bf16 [M, K], packed, G, sz bf16 [K/G, N, 2])``, the same ``(q - 8)·s + z``;
  K % (16·innerKTiles) == 0, N % 8 == 0.
- **int4, q4x8** (:mod:`~expertcache.offload.q4x8`, numba; the int4 experts' kernel on AVX2 CPUs,
  :func:`expert_kernel`, and there the int4 dense part's, :func:`dense_int4_kernel`): codes two a byte [N, K/2] in blocks of 32 (byte j: code j low nibble, code j + 16 high),
  scales and zeros [N, K/G, 2] in the compute dtype: the int4pack layout's bytes in another order, its own layout
  name (``q4x8``: its own sidecar); x quantised per row to int8 per call; G ≤ 256, K % 32 == 0.
- **int8**: ``_weight_int8pack_mm(x [M, K], q int8 [N, K], s [N])`` = ``x @ (q * s[:, None]).T``, s in x's
  dtype; K % 16 == 0 (other K give silently wrong results in 2.13: K = 104 is off by 400×). One layout for
  both devices; CUDA computes ``linear(x, q.to(dtype)) * s`` (no fused int8 CUDA kernel to check against here).

Shapes a kernel cannot take are **padded**, never sent to a slower path: K up to :func:`k_align` (int4: G,
int8: 16) with zero columns (x is padded with zeros, so the padded weights multiply zeros), N up to 16 (int4)
with rows of scale 0 and zero 0 (exact zeros, sliced off). An expert's gate and up halves are padded to
``Fp`` rows each, so ``act(gate) * up`` is already ``down``'s padded K. The shipped models (D = 144,
F = 104 / 416) run int4 with G = 32: gate_up K 144 -> 160, down K 104 -> 128 (granular); int8: K 144 -> 144,
104 -> 112.

Quantisation (:func:`quantize_codes`): int8 ``s = max|w| / 127`` per row, ``q = round(w / s)`` in
[-127, 127]; int4 per group of G along K ``s = (max - min) / 15``, ``z = min + 8·s``, ``q = round((w - z) / s) +
8`` in [0, 15]; scales and zeros are rounded to the compute dtype first, so the stored values are the ones
the codes were made for.

One expert is ``[gate_up weight | gate_up scales | down weight | down scales]``, each part 64-byte aligned, one
uint8 blob of :attr:`QuantLayout.nbytes`; :meth:`QuantLayout.views` gives the four kernel tensors as views of it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from expertcache.offload import groupfit
from expertcache.offload.groupfit import hqq_zero as _hqq_zero, lsq_torch as _lsq  # noqa: F401 - former homes
from expertcache.offload import q4x8

__all__ = ["QUANT_PRESETS", "resolve_preset", "cpu_description", "dense_int8_kernel", "dense_int4_kernel",
           "DENSE_INT4_KERNELS", "DENSE_INT4_KERNEL_VAR", "dense_layout_kernel", "fbgemm_vnni", "QUANT_MODES", "KERNEL_GROUPS", "FORMAT_VERSION", "PACK_ROWS", "QuantMatrix", "QuantLayout", "default_group",
           "kernel_for", "expert_layout_kernel", "k_align", "OPTIMIZERS", "quantize_codes", "pack_matrix", "pack_matrix_into", "qmm", "pack_expert", "quant_mlp",
           "padding_note", "EXPERT_KERNELS", "choose_expert_kernel", "expert_kernel", "int4pack_codes",
           "PROBED"]

QUANT_MODES = ("int8", "int4")
#: the group sizes the int4 kernels take
KERNEL_GROUPS = (32, 64, 128, 256)
#: the sidecar format: 1 = group-wise blobs dequantised per use; 2 = the fused kernels' packed layouts
FORMAT_VERSION = 2
_ALIGN = 64  # bytes: every part of a blob starts on a cache line (and on its dtype's size)
_INNER_K_TILES = 2  # tinygemm: K % 32 == 0 (every G in KERNEL_GROUPS divides a padded K)


#: CPU ISA flags that choose kernels (reported in every benchmark row and the kernel-choice line)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
             "amx_int8", "amx_bf16", "asimd", "sve", "i8mm", "bf16")
#: what caps torch's three CPU kernel libraries at an ISA (each reads its own variable once, at start-up), and numba's
#: target (the q4x8 expert kernel, offload/q4x8.py: with the CPU name alone numba keeps the host's features)
ISA_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS", "NUMBA_CPU_NAME",
            "NUMBA_CPU_FEATURES")


def cpu_description() -> dict:
    """The CPU model, its kernel-choosing ISA flags, ATen's dispatch capability and any ISA caps set in the
    environment: what a speed row needs to be read on another machine."""
    from pathlib import Path

    model, flags = "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "Model", "CPU part") and model == "?":
                model = line.split(":", 1)[1].strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    import os

    return dict(cpu=model, cpu_flags=[f for f in ISA_FLAGS if f in flags],
                aten_capability=torch.backends.cpu.get_cpu_capability(),
                isa_env={k: os.environ[k] for k in ISA_VARS if k in os.environ})


def dense_int8_kernel(device: torch.device | str = "cpu", *, compiled: bool = False) -> str:
    """The int8 dense product on ``device``: ``fbgemm`` (``quantized.linear_dynamic``: the activation quantised
    per call to 8 bits, int8 × int8 on FBGEMM's AVX2 / AVX-512-VNNI kernels) on an x86 CPU where torch has FBGEMM,
    else ``int8pack`` (``_weight_int8pack_mm``, bf16 activations). The survey (BENCHMARKS.md "Which 4-bit kernel on
    which CPU", benchmarks/bench_kernels.py): FBGEMM 2.3-2.7× bf16 on the OLMoE-1B-7B shapes with AVX2, where
    ``_weight_int8pack_mm`` is 0.96-1.14× and ``_weight_int4pack_mm_for_cpu`` 0.75-0.97×. ``compiled``: the dense
    part runs under ``torch.compile`` (``--compile``), which does not trace FBGEMM's packed-weight object:
    ``int8pack``."""
    if torch.device(device).type != "cpu" or compiled:
        return "int8pack"
    return "fbgemm" if "fbgemm" in torch.backends.quantized.supported_engines else "int8pack"


#: the int4 dense products on a CPU (:func:`dense_int4_kernel`): torch's int4 kernel, or q4x8 (offload/q4x8.py)
DENSE_INT4_KERNELS = ("int4pack", "q4x8")
#: forces :func:`dense_int4_kernel` (benchmarks, tests): one of :data:`DENSE_INT4_KERNELS`
DENSE_INT4_KERNEL_VAR = "EXPERTCACHE_DENSE_INT4_KERNEL"


def dense_int4_kernel(device: torch.device | str = "cpu", *, compiled: bool = False) -> str:
    """The int4 dense product (``--quant-dense int4`` / ``int4-head8``: attention, an int4 ``lm_head``) on ``device``:
    ``q4x8`` (int8 activations per row × int4, offload/q4x8.py) where :func:`choose_expert_kernel` would put int4
    experts on it (an AVX2 x86 CPU, numba available: 3× bf16 per matrix where torch's int4 kernel is 0.75×), else
    ``int4pack`` (``_weight_int4pack_mm_for_cpu``; tinygemm on CUDA). The rule is the CPU's own choice:
    ``$EXPERTCACHE_EXPERT_KERNEL`` forces the experts only; ``$EXPERTCACHE_DENSE_INT4_KERNEL`` (one of
    :data:`DENSE_INT4_KERNELS`) forces this one on the CPU (ValueError naming it for another value, or q4x8 without
    numba). ``compiled`` (``--compile``: the graph must trace the product; q4x8 is a ctypes call) and a GPU:
    ``int4pack`` whatever is set."""
    import os

    forced = os.environ.get(DENSE_INT4_KERNEL_VAR, "").strip() or None
    if forced is not None and forced not in DENSE_INT4_KERNELS:
        raise ValueError(f"{DENSE_INT4_KERNEL_VAR} must be one of {', '.join(DENSE_INT4_KERNELS)}, got {forced!r}")
    if torch.device(device).type != "cpu" or compiled:
        return "int4pack"
    if forced == q4x8.KERNEL and not q4x8.available():
        raise ValueError(f"{DENSE_INT4_KERNEL_VAR}=q4x8 needs numba (not installed, or EXPERTCACHE_NO_NUMBA is set)")
    if forced:
        return forced
    got = choose_expert_kernel(torch.backends.cpu.get_cpu_capability(), torch.backends.quantized.supported_engines,
                               None, q4x8.available(), torch.get_num_threads() == 1)
    return q4x8.KERNEL if got == q4x8.KERNEL else "int4pack"


def dense_layout_kernel(mode: str, device: torch.device | str = "cpu", *, compiled: bool = False) -> str:
    """The packed layout of a dense matrix of ``mode`` on ``device``: ``q4x8`` where :func:`dense_int4_kernel`
    runs it (its own layout name: the dense cache's key), else :func:`kernel_for`."""
    if mode == "int4" and dense_int4_kernel(device, compiled=compiled) == q4x8.KERNEL:
        return q4x8.KERNEL
    return kernel_for(mode, device)


def fbgemm_vnni() -> bool:
    """Whether FBGEMM runs its AVX-512 VNNI kernels here (the CPU has avx512_vnni and FBGEMM_ENABLE_INSTRUCTIONS
    does not cap it below): int8 activations may then use all 8 bits (:class:`~expertcache.offload.qlinear.QuantLinear`)."""
    import os

    cap = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper()
    return "avx512_vnni" in cpu_description()["cpu_flags"] and cap in ("", "AVX512_E1", "AVX512_VNNI")


#: the int4 experts' products on a CPU (:func:`expert_kernel`): torch's int4 kernel on the slot's bytes, FBGEMM's
#: int8 × int8 on a per-slot re-quantised copy (offload/fbexperts.py), or int8 activations × the slot's int4 bytes in
#: the q4x8 layout (offload/q4x8.py, numba)
EXPERT_KERNELS = ("int4pack", "fbgemm", "q4x8")
#: forces :func:`expert_kernel` (benchmarks): one of :data:`EXPERT_KERNELS`
EXPERT_KERNEL_VAR = "EXPERTCACHE_EXPERT_KERNEL"


def choose_expert_kernel(aten_capability: str, engines, forced: str | None = None, numba: bool = False,
                         one_thread: bool = False) -> str:
    """The int4 experts' product on a CPU whose ATen dispatch capability is ``aten_capability`` with the quantized
    ``engines`` torch has, ``numba`` whether the q4x8 kernel can be compiled, ``one_thread`` whether torch runs one
    thread: ``forced`` if given (one of :data:`EXPERT_KERNELS`, else ValueError naming :data:`EXPERT_KERNEL_VAR`);
    else on AVX-512 ``q4x8`` with one thread and numba (8-layer OLMoE-1B-7B shape, C = N, AMD EPYC: experts 12.1 ms a
    token, torch's int4 kernel 20.0-20.4), else ``int4pack`` (it uses torch's threads); ARM ``int4pack``; on AVX2 ``q4x8`` where
    numba is available (int8 activations × int4 on ``vpmaddubsw``: offload/q4x8.py; AVX2-capped AMD EPYC, one token, one thread, G = 64: 2.8-3.1× bf16 per matrix, FBGEMM 2.3×, the int4 kernel
    0.8×; benchmarks/results/kernels.jsonl), ``fbgemm`` elsewhere (AVX2: the int4 kernel 0.74-0.97× bf16, FBGEMM
    2.3-2.7×; BENCHMARKS.md "Which 4-bit kernel on which CPU")."""
    if forced:
        if forced not in EXPERT_KERNELS:
            raise ValueError(f"{EXPERT_KERNEL_VAR} must be one of {', '.join(EXPERT_KERNELS)}, got {forced!r}")
        if forced == "fbgemm" and "fbgemm" not in engines:
            raise ValueError(f"{EXPERT_KERNEL_VAR}=fbgemm, but this torch has no FBGEMM (engines: {', '.join(engines)})")
        if forced == "q4x8" and not numba:
            raise ValueError(f"{EXPERT_KERNEL_VAR}=q4x8 needs numba (not installed, or EXPERTCACHE_NO_NUMBA is set)")
        return forced
    if aten_capability.upper().startswith("AVX512") and "fbgemm" in engines:
        return "q4x8" if numba and one_thread else "int4pack"
    if aten_capability.upper().startswith("AVX512") or "fbgemm" not in engines:
        return "int4pack"
    return "q4x8" if numba and aten_capability.upper() == "AVX2" else "fbgemm"


#: ATen capability -> (the expert kernel a timing on this CPU chose where :func:`choose_expert_kernel` offers FBGEMM,
#: {kernel: seconds per one-token gate_up product}) (``fbexperts.slot_kernel`` records it; :func:`expert_kernel`
#: and the kernel line report it)
PROBED: dict[str, tuple[str, dict]] = {}


def expert_kernel(mode: str | None, device: torch.device | str = "cpu", *, probed: bool = True) -> str | None:
    """The product quantised experts of ``mode`` run on, on ``device``: None for unquantised experts, ``int8pack``
    for int8, ``int4pack`` (the fused kernel of :func:`qmm`) for int4 on a GPU and where
    :func:`choose_expert_kernel` says so for this CPU (``$EXPERTCACHE_EXPERT_KERNEL`` forcing either), else
    ``fbgemm`` or ``q4x8`` -- FBGEMM unless a timing of both on this CPU (:data:`PROBED`, ``probed``) found it no
    faster."""
    import os

    if mode is None:
        return None
    if mode != "int4" or torch.device(device).type != "cpu":
        return "int4pack" if mode == "int4" else "int8pack"
    forced = os.environ.get(EXPERT_KERNEL_VAR, "").strip() or None
    cap = torch.backends.cpu.get_cpu_capability()
    got = choose_expert_kernel(cap, torch.backends.quantized.supported_engines, forced, q4x8.available(),
                               torch.get_num_threads() == 1)
    return PROBED.get(cap, (got,))[0] if probed and got == "fbgemm" and not forced else got


def default_group(d: int, f: int) -> int:
    """The int4 group size: 64 where it divides D and F (OLMoE-1B-7B: D = 2048, F = 1024), else 32 with K
    padded (the shipped models: D = 144, F = 104 / 416)."""
    return 64 if d % 64 == 0 and f % 64 == 0 else 32


def expert_layout_kernel(mode: str, device: torch.device | str = "cpu") -> str:
    """The packed layout of the experts of ``mode`` on ``device``: ``q4x8`` where :func:`expert_kernel` runs int4
    experts on it (its own layout, so its own sidecar), else :func:`kernel_for`."""
    if mode == "int4" and torch.device(device).type == "cpu" and expert_kernel(mode, device, probed=False) == "q4x8":
        return q4x8.KERNEL
    return kernel_for(mode, device)


def kernel_for(mode: str, device: torch.device | str = "cpu") -> str:
    """The name of the packed layout ``mode`` uses on ``device``: ``plain`` (int8, any device), ``cuda``
    (tinygemm), or ``cpu-<capability>`` (int4 CPU: its packing depends on the vector width)."""
    if mode == "int8":
        return "plain"
    if torch.device(device).type == "cuda":
        return "cuda"
    return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


def k_align(mode: str, group: int) -> int:
    """The multiple the kernel needs K to be (module docstring)."""
    return group if mode == "int4" else 16


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class QuantMatrix:
    """One weight matrix [N, K] (``x @ W.T``) in a kernel's layout: ``n_pad`` × ``k_pad`` stored, scales and
    zeros in ``dtype``. ``group`` is the int4 group size (int8: per output row); ``optimize`` how int4 scales
    and zeros are chosen (:data:`OPTIMIZERS`)."""

    mode: str
    kernel: str
    n: int
    k: int
    group: int
    dtype: torch.dtype
    optimize: str = "minmax"

    @property
    def k_pad(self) -> int:
        return _up(self.k, k_align(self.mode, self.group))

    @property
    def n_pad(self) -> int:
        return _up(self.n, 16) if self.mode == "int4" else self.n

    @property
    def sz_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.kernel == "cuda" else self.dtype

    def shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
        """((weight shape, dtype), (scales shape, dtype)) as the kernel takes them."""
        n, k = self.n_pad, self.k_pad
        if self.mode == "int8":
            return ((n, k), torch.int8), ((n,), self.dtype)
        sz = ((n, k // self.group, 2) if self.kernel == q4x8.KERNEL else (k // self.group, n, 2), self.sz_dtype)
        if self.kernel == "cuda":
            return ((n // 8, k // (16 * _INNER_K_TILES), 32, _INNER_K_TILES // 2), torch.int32), sz
        return ((n, k // 2), torch.uint8), sz

    def part_bytes(self) -> tuple[int, int]:
        return tuple(math.prod(s) * d.itemsize for s, d in self.shapes())

    @property
    def nbytes(self) -> int:
        return sum(_up(b, _ALIGN) for b in self.part_bytes())

    def views(self, buf_u8: torch.Tensor, at: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, scales) as views of ``buf_u8`` from byte ``at`` (64-byte aligned)."""
        out = []
        for (shape, dtype), nb in zip(self.shapes(), self.part_bytes()):
            out.append(buf_u8[at:at + nb].view(dtype).view(shape))
            at += _up(nb, _ALIGN)
        return out[0], out[1]


#: how int4 scales and zeros are chosen per group (:func:`quantize_codes`)
OPTIMIZERS = ("minmax", "hqq", "lsq")
#: named recipes ``--quant`` also takes: the settings each stands for (BENCHMARKS.md "A 4-bit preset": quality,
#: bits per weight). q4: experts int4 with least-squares scales and zeros; the dense part (attention, lm_head,
#: embedding: the sensitive tensors, as Q4_K_M keeps its attention v / output at 6 bits) int8.
QUANT_PRESETS = {"q4": dict(quant="int4", quant_dense="int8", quant_opt="lsq"),
                 # per-tensor like llama.cpp's Q4_K_M: everything int4 but lm_head (int8); at Q4_K_M's bits
                 "q4m": dict(quant="int4", quant_dense="int4-head8", quant_opt="lsq")}


def resolve_preset(offload):
    """``offload`` (an OffloadConfig) with a preset name in ``quant`` replaced by the settings it stands for; a
    dense precision or an optimiser given beside it is kept (the preset fills only what was left unset)."""
    preset = QUANT_PRESETS.get(offload.quant)
    if preset is None:
        return offload
    dense = offload.quant_dense or preset["quant_dense"]  # "none" given beside the preset: kept unquantised
    return dataclasses.replace(offload, quant=preset["quant"], quant_dense=None if dense == "none" else dense,
                               quant_opt=preset["quant_opt"] if offload.quant_opt == "minmax" else offload.quant_opt)


def quantize_codes(w_NK: torch.Tensor, mode: str, group: int, dtype: torch.dtype, *, optimize: str = "minmax"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes int32 [N, K], scales, zeros) of ``w_NK`` (K a multiple of ``k_align``): int8 codes in
    [-127, 127] with scales [N]; int4 codes in [0, 15] with scales and zeros [N, K/G] (module docstring).
    Scales and zeros are in ``dtype``: ``W ≈ q·s`` (int8), ``W ≈ (q - 8)·s + z`` (int4).

    ``optimize`` (int4): ``minmax`` (each group's range: s = (max - min) / 15), ``hqq`` (that scale, the zero
    refined by :func:`~.groupfit.hqq_zero`) or ``lsq`` (scale and offset by least squares,
    :func:`~.groupfit.lsq`, compiled where numba is). Whichever, the codes
    are the rounding of W under the stored (``dtype``-rounded) scale and zero."""
    if optimize not in OPTIMIZERS:
        raise ValueError(f"int4 scale optimisation must be one of {', '.join(OPTIMIZERS)}, got {optimize!r}")
    w = w_NK.float()
    if mode == "int8":
        q, s_N = groupfit.quantize_int8(w, dtype)
        return q, groupfit.as_dtype(s_N, dtype), None
    n, k = w.shape
    q, s, z = groupfit.quantize_int4(w.reshape(n, k // group, group), dtype, optimize)
    return q.reshape(n, k), groupfit.as_dtype(s, dtype), groupfit.as_dtype(z, dtype)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return w if w.shape[0] == rows else torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])


def _pad_cols(w: torch.Tensor, cols: int, mode: str = "constant") -> torch.Tensor:
    """``w`` with columns appended up to ``cols``: zeros, or (``'replicate'``) copies of its last column,
    which leave the last group's minimum and maximum as they were."""
    if w.shape[-1] == cols:
        return w
    return F.pad(w, (0, cols - w.shape[-1])) if mode == "constant" else \
        F.pad(w[None], (0, cols - w.shape[-1]), mode="replicate")[0]


def pack_matrix(w_NK: torch.Tensor, qm: QuantMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scales) of ``w_NK`` [qm.n, ≤ qm.k_pad] in ``qm``'s kernel layout (CPU tensors; a ``cuda``
    layout is packed on the current CUDA device). Columns up to ``k_pad`` repeat the last one (they multiply
    zeros of x; the last group keeps its range); rows up to ``n_pad`` have scale and zero 0 (exact zeros)."""
    if w_NK.dim() != 2 or w_NK.shape[0] != qm.n or w_NK.shape[1] > qm.k_pad:
        raise ValueError(f"matrix {tuple(w_NK.shape)} does not match its layout [{qm.n}, {qm.k}]")
    w = _pad_cols(w_NK.float(), qm.k_pad, "replicate")
    q, s, z = quantize_codes(w, qm.mode, qm.group, qm.sz_dtype, optimize=qm.optimize if qm.mode == "int4" else "minmax")
    q, s = _pad_rows(q, qm.n_pad), (s if qm.n_pad == qm.n else F.pad(s.T, (0, qm.n_pad - qm.n)).T)
    if qm.mode == "int8":
        return q.to(torch.int8).contiguous(), s.contiguous()
    z = z if qm.n_pad == qm.n else F.pad(z.T, (0, qm.n_pad - qm.n)).T
    if qm.kernel == q4x8.KERNEL:  # codes two a byte, (s, z) per row and group [N, K/G, 2] (offload/q4x8.py)
        return q4x8.pack_codes(q), groupfit.scales_zeros(s, z)
    sz = groupfit.scales_zeros(s.T, z.T)  # [K/G, N, 2]
    if qm.kernel == "cuda":  # pragma: no cover - GPU only (tests/test_quant_kernels.py, -m gpu)
        u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).cuda()
        return torch.ops.aten._convert_weight_to_int4pack(u8, _INNER_K_TILES).cpu(), sz
    if qm.kernel != kernel_for("int4", "cpu"):
        raise ValueError(f"layout {qm.kernel!r} cannot be packed on this CPU ({kernel_for('int4', 'cpu')})")
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


#: rows of the int4pack layout unpacked at a time by :func:`int4pack_codes` (a multiple of every CPU layout's row
#: block: 64 AVX-512, 32 AVX2 and none), so its permutation is held for one block, not the matrix
_UNPACK_ROWS = 256
_UNPACK_ORDER: dict[tuple, torch.Tensor] = {}


def _unpack_order(n: int, k: int) -> torch.Tensor:
    """The permutation the CPU int4 packing applies to an [n, k] matrix, this capability: int64 [n·k], for each
    element (row-major) the position of its nibble in the packed bytes (low nibble, then high, in byte order).
    Found by packing the matrix of element indices, four bits at a time, so it holds whatever the capability's
    layout is."""
    key = (n, k, torch.backends.cpu.get_cpu_capability())
    got = _UNPACK_ORDER.get(key)
    if got is None:
        idx = torch.arange(n * k, dtype=torch.int64).view(n, k)
        where = torch.zeros(n * k, dtype=torch.int64)  # nibble position -> element
        for shift in range(0, max(4, (n * k - 1).bit_length()), 4):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(((idx >> shift) & 15).to(torch.int32), 1)
            where |= _nibbles(packed).view(-1).long() << shift
        got = _UNPACK_ORDER.setdefault(key, torch.argsort(where))
    return got


def _nibbles(packed_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2·B]: each byte's low nibble, then its high nibble."""
    return torch.stack([packed_u8 & 15, packed_u8 >> 4], dim=-1).flatten(-2)


def int4pack_codes(weight_u8: torch.Tensor, qm: QuantMatrix) -> torch.Tensor:
    """The codes (uint8 [n_pad, k_pad] in 0..15) a CPU int4 weight of ``qm`` (``QuantMatrix.shapes``'s uint8
    [n_pad, k_pad / 2], packed on this capability) was packed from: the inverse of ``pack_matrix``'s
    ``_convert_weight_to_int4pack_for_cpu``, :data:`_UNPACK_ROWS` rows at a time where the row count divides."""
    if qm.mode == "int4" and qm.kernel == q4x8.KERNEL:
        return q4x8.unpack_codes(weight_u8)
    if qm.mode != "int4" or qm.kernel != kernel_for("int4", "cpu"):
        raise ValueError(f"{qm.mode} layout {qm.kernel!r} is not this CPU's int4 layout ({kernel_for('int4', 'cpu')})")
    n, k = qm.n_pad, qm.k_pad
    rows = _UNPACK_ROWS if n % _UNPACK_ROWS == 0 else n
    order = _unpack_order(rows, k)
    out = torch.empty(n, k, dtype=torch.uint8)
    for a in range(0, n, rows):
        out[a:a + rows].view(-1).copy_(torch.take(_nibbles(weight_u8[a:a + rows]), order))
    return out


#: rows packed at a time by :func:`pack_matrix_into` (a multiple of 64: the CPU int4 layout's row block, and of
#: tinygemm's 8), so packing a large matrix holds one block in float32, not the matrix
PACK_ROWS = 1024


def pack_matrix_into(rows_of: Callable[[int, int], torch.Tensor], qm: QuantMatrix, weight: torch.Tensor,
                     scales: torch.Tensor, *, rows: int = PACK_ROWS) -> None:
    """Pack the matrix [qm.n, ≤ qm.k_pad] whose rows [a, b) ``rows_of(a, b)`` returns into ``weight`` and
    ``scales`` (tensors of :meth:`QuantMatrix.shapes`, on any device), ``rows`` rows at a time: the result
    equals :func:`pack_matrix` of the whole matrix (each block is packed as its own matrix; the layouts keep
    rows apart in blocks of ``rows``), while the transient is one block. ``rows`` is a multiple of 64."""
    if rows <= 0 or rows % 64:
        raise ValueError(f"rows must be a positive multiple of 64, got {rows}")
    for a in range(0, qm.n, rows):
        b = min(qm.n, a + rows)
        sub = dataclasses.replace(qm, n=b - a)
        w, s = pack_matrix(rows_of(a, b), sub)
        end = a + sub.n_pad  # the last block carries the row padding
        if qm.mode == "int8":
            weight[a:end].copy_(w)
            scales[a:end].copy_(s)
            continue
        if qm.kernel == "cuda":  # pragma: no cover - GPU only
            weight[a // 8:end // 8].copy_(w)
        else:
            weight[a:end].copy_(w)
        (scales[a:end] if qm.kernel == q4x8.KERNEL else scales[:, a:end]).copy_(s)


def qmm(x_MK: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, qm: QuantMatrix) -> torch.Tensor:
    """``x_MK @ W.T`` [M, qm.n] with the fused kernel of ``qm`` (x's K padded with zeros to ``qm.k_pad``)."""
    if qm.kernel == q4x8.KERNEL:  # int8 activations × int4 (offload/q4x8.py): the padding done in the kernel
        return q4x8.q4x8_mm(x_MK, weight, scales, qm.group, qm.n)
    x = _pad_cols(x_MK, qm.k_pad)
    if qm.mode == "int8":
        if x.device.type == "cuda":  # pragma: no cover - GPU only
            y = F.linear(x, weight.to(x.dtype)) * scales
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), weight, scales)
    elif qm.kernel == "cuda":  # pragma: no cover - GPU only
        y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), weight, qm.group,
                                               scales).to(x.dtype)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight, qm.group, scales)
    return y if qm.n_pad == qm.n else y[:, :qm.n]


@dataclass(frozen=True)
class QuantLayout:
    """Byte layout of one quantised expert (D hidden, F intermediate, G int4 group size, compute ``dtype``,
    ``kernel`` from :func:`kernel_for`): gate_up [2·Fp, D] (gate rows, then up rows, each half padded to
    ``Fp``) and down [D, Fp]. ``optimize``: how int4 scales and zeros are chosen (:data:`OPTIMIZERS`)."""

    mode: str
    d: int
    f: int
    group: int
    dtype: torch.dtype = torch.bfloat16
    kernel: str = ""
    optimize: str = "minmax"

    def __post_init__(self) -> None:
        if self.mode not in QUANT_MODES:
            raise ValueError(f"quantisation must be one of {QUANT_MODES}, got {self.mode!r}")
        if self.mode == "int4" and self.group not in KERNEL_GROUPS:
            raise ValueError(f"group size (--group) must be one of {', '.join(map(str, KERNEL_GROUPS))} (the int4 "
                             f"kernels'), got {self.group!r}")
        if self.optimize not in OPTIMIZERS:
            raise ValueError(f"int4 scale optimisation must be one of {', '.join(OPTIMIZERS)}, got {self.optimize!r}")
        if not self.kernel:
            object.__setattr__(self, "kernel", kernel_for(self.mode))

    @property
    def f_pad(self) -> int:
        return _up(self.f, k_align(self.mode, self.group))

    @property
    def gate_up(self) -> QuantMatrix:
        return QuantMatrix(self.mode, self.kernel, 2 * self.f_pad, self.d, self.group, self.dtype, self.optimize)

    @property
    def down(self) -> QuantMatrix:
        return QuantMatrix(self.mode, self.kernel, self.d, self.f_pad, self.group, self.dtype, self.optimize)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def views(self, blob_u8: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(gate_up weight, gate_up scales, down weight, down scales): views of one expert's blob."""
        return (*self.gate_up.views(blob_u8, 0), *self.down.views(blob_u8, self.gate_up.nbytes))


def pack_expert(gate_up_FD: torch.Tensor, down_DF: torch.Tensor, layout: QuantLayout) -> torch.Tensor:
    """One expert (gate_up [2F, D], down [D, F]) as a uint8 blob of ``layout.nbytes`` bytes."""
    f = layout.f
    gate, up = gate_up_FD[:f], gate_up_FD[f:]
    gu = gate_up_FD if layout.f_pad == f else torch.cat([_pad_rows(gate, layout.f_pad), _pad_rows(up, layout.f_pad)])
    blob = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for qm, w, at in ((layout.gate_up, gu, 0), (layout.down, down_DF, layout.gate_up.nbytes)):
        for dst, src in zip(qm.views(blob, at), pack_matrix(w, qm)):
            # one memcpy of the bytes (torch's copy_ waits on its thread pool on a busy machine)
            dst.reshape(-1).view(torch.uint8).numpy()[:] = src.contiguous().reshape(-1).view(torch.uint8).numpy()
    return blob


def quant_mlp(layout: QuantLayout, act):
    """``f(x_TD, views) -> h_TD``: the ``linear`` expert MLP (``down(act(gate) * up)``) with the fused kernels
    on an expert's blob views (:meth:`QuantLayout.views`)."""
    gu_m, down_m = layout.gate_up, layout.down

    def mlp(x_TD, w):
        gu_w, gu_s, down_w, down_s = w
        gate, up = qmm(x_TD, gu_w, gu_s, gu_m).chunk(2, dim=-1)  # [T, Fp] each (padded rows compute 0)
        return qmm(act(gate) * up, down_w, down_s, down_m)
    return mlp


def padding_note(layout: QuantLayout) -> str:
    """One line for the plan and the logs: the kernel, the group and any padding of K and N."""
    gu, dn = layout.gate_up, layout.down
    name = {"int8": "_weight_int8pack_mm", "int4": "q4x8 (numba int8 x int4)" if layout.kernel == q4x8.KERNEL else
            "_weight_int4pack_mm" + ("" if layout.kernel == "cuda" else "_for_cpu")}
    grp = f" G={layout.group}" + (f" {layout.optimize}" if layout.optimize != "minmax" else "") \
        if layout.mode == "int4" else " per-channel"
    pads = [f"{what} {m.k}->{m.k_pad}" for what, m in (("gate_up K", gu), ("down K", dn)) if m.k_pad != m.k]
    pads += [f"down N {dn.n}->{dn.n_pad}"] if dn.n_pad != dn.n else []
    pads += [f"F {layout.f}->{layout.f_pad} rows per half"] if layout.f_pad != layout.f else []
    fb = layout.kernel.startswith("cpu-") and expert_kernel(layout.mode) == "fbgemm"
    return f"{layout.mode} {name[layout.mode]}{grp} [{layout.kernel}]" + \
        (" (where C = N: re-quantised per slot to int8 per channel, FBGEMM quantized.linear_dynamic)" if fb else "") + \
        (f", zero-padded: {', '.join(pads)}" if pads else ", no padding")

"""int4 experts on FBGEMM: offered on x86 CPUs without AVX-512 where the q4x8 kernel is not (no numba, or no AVX2:
``quant.expert_kernel``; offload/q4x8.py runs int8 activations on the slot's own int4 bytes, no copy), used where a
timing on this CPU finds it clearly faster (:func:`slot_kernel`), or forced by ``$EXPERTCACHE_EXPERT_KERNEL``.

On an AMD EPYC capped at AVX2 torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) is no faster than bf16, while
FBGEMM's int8 × int8 product (``quantized.linear_dynamic``, the dense part's kernel:
:mod:`~expertcache.offload.qlinear`) is 2.3-2.7×; on an Intel Xeon capped alike the two tie (BENCHMARKS.md "Which
4-bit kernel on which CPU"), hence the timing. So an int4 expert read into a slot keeps its bytes there (the
sidecar's, the reads', the plan's slot: unchanged) and, the first time it is computed from that slot, gets a
**packed copy per slot**: its int4 groups dequantised (:func:`~expertcache.offload.quant.int4pack_codes`,
``W = (q - 8)·s + z``), re-quantised per output channel to int8 (``s = max|W_row| / 127``) and handed to
``quantized.linear_prepack``. :class:`~expertcache.offload.views.SlotViews` keeps the copy in the slot's placement,
which every read into the slot resets (``SlotReads.submit``), so a refilled slot is packed again and never computes
with the expert it held before. The copy's bytes (:func:`packed_bytes`: the int8 codes and FBGEMM's per-column
terms of both matrices) are counted per slot by the memory plan (``preflight.plan_from``): each slot costs its
int4 bytes plus them (about 3× the int4 expert alone).

**Only where every expert is resident** (C = N): making a copy costs 0.2-0.5 s an expert (the unpacking, two
roundings and FBGEMM's own packing of 6 M weights; the OLMoE-1B-7B shape, one thread, a loaded machine), hundreds of times
the product it speeds up, so it pays for an expert that stays in its slot and not for a miss. With C < N (a plan
that cannot hold every expert and its copy) the slots keep torch's int4 kernel and the plan counts no copy;
with C = N the copies are made as each expert is first computed (the first tokens pay them). A budget that holds
every int4 expert but not their copies gets C = N without copies.

Values: the product is ``x @ W8.T`` with W8 the int8 re-quantisation of the int4 expert (an extra rounding of at
most half an int8 step per weight, ``max|W_row| / 254``) and x quantised per token to 8 bits where FBGEMM runs
VNNI, 7 elsewhere (``reduce_range``: AVX2's ``vpmaddubsw`` sums pairs of u8 × s8 products in int16), several rows
each scaled to max |x| = 1 first as :class:`~expertcache.offload.qlinear.QuantLinear` does, so one scale per token.
The gate/up products, the activation and the down product run in float32; the result is cast to x's dtype.
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

import torch

from expertcache.offload import q4moe
from expertcache.offload.quant import (EXPERT_KERNEL_VAR, PROBED, QuantLayout, QuantMatrix, expert_kernel, fbgemm_vnni,
                                       int4pack_codes, qmm, quant_mlp)

__all__ = ["FbgemmExpert", "dequantize", "prepack_expert", "fbgemm_mlp", "packed_bytes", "slot_prepack", "slot_mlps",
           "slot_copy_bytes", "slot_kernel", "probe", "PROBE_MARGIN"]


class FbgemmExpert(NamedTuple):
    """One expert's FBGEMM packed weights: gate_up [2·Fp, D] and down [D, Fp] (``linear_prepack`` objects)."""

    gate_up: object
    down: object


def dequantize(weight: torch.Tensor, scales: torch.Tensor, qm: QuantMatrix) -> torch.Tensor:
    """float32 [qm.n_pad, qm.k]: the matrix the int4 kernel multiplies by, ``(q - 8)·s + z`` per group, from its
    kernel tensors (``QuantMatrix.views``); the K padding columns dropped."""
    q = int4pack_codes(weight, qm)
    n, g = qm.n_pad, qm.group
    s_NB, z_NB = scales[..., 0].T.float(), scales[..., 1].T.float()  # sz [K/G, N, 2]
    w = (q.view(n, -1, g).float().sub_(8)).mul_(s_NB[..., None]).add_(z_NB[..., None])
    return w.view(n, qm.k_pad)[:, :qm.k]


def _prepack(w_NK: torch.Tensor) -> object:
    """FBGEMM's packed int8 weight of ``w_NK`` (float32), per output channel ``s = max|row| / 127`` (1 for a row of
    zeros)."""
    s = (w_NK.abs().amax(dim=1).double() / 127)
    s = torch.where(s > 0, s, torch.ones_like(s))
    with warnings.catch_warnings():  # torch deprecates quantized tensors; FBGEMM's op still takes one
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w_NK, s, torch.zeros_like(s, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None)


@torch.no_grad()
def prepack_expert(views: tuple[torch.Tensor, ...], layout: QuantLayout) -> FbgemmExpert:
    """One int4 expert's FBGEMM copy from its kernel tensors (``QuantLayout.views``: gate_up weight and scales,
    down weight and scales). gate_up keeps its padded rows (zeros: each half stays ``Fp`` rows, so
    ``act(gate) * up`` is down's K); down's rows past D are dropped."""
    gu_w, gu_s, dn_w, dn_s = views
    return FbgemmExpert(_prepack(dequantize(gu_w, gu_s, layout.gate_up)),
                        _prepack(dequantize(dn_w, dn_s, layout.down)[:layout.d]))


def packed_bytes(layout: QuantLayout) -> int:
    """Bytes of one expert's FBGEMM copy: the int8 codes of gate_up [2·Fp, D] and down [D, Fp] and, per output
    column, FBGEMM's int32 column offset and the per-channel scale (float64) and zero point (int64)."""
    gu, dn = layout.gate_up, layout.down
    return gu.n_pad * gu.k + layout.d * dn.k + 20 * (gu.n_pad + layout.d)


def _linear(x_MK: torch.Tensor, packed: object, reduce_range: bool) -> torch.Tensor:
    """``x_MK @ W.T`` (float32) with one activation scale per row (rows scaled to max |x| = 1 first; one row is
    FBGEMM's own per-call scale already)."""
    if x_MK.shape[0] == 1:
        return torch.ops.quantized.linear_dynamic(x_MK, packed, reduce_range)
    m_M1 = x_MK.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.ops.quantized.linear_dynamic(x_MK / m_M1, packed, reduce_range) * m_M1


def fbgemm_mlp(act: Callable, *, reduce_range: bool | None = None) -> Callable:
    """``f(x_TD, expert) -> h_TD``: the ``linear`` expert MLP (``down(act(gate) * up)``) on an
    :class:`FbgemmExpert`; ``reduce_range`` (7-bit activations) defaults to FBGEMM's need here (module docstring)."""
    rr = (not fbgemm_vnni()) if reduce_range is None else reduce_range

    def mlp(x_TD: torch.Tensor, w: FbgemmExpert) -> torch.Tensor:
        gate, up = _linear(x_TD.float(), w.gate_up, rr).chunk(2, dim=-1)
        return _linear(act(gate) * up, w.down, rr).to(x_TD.dtype)
    return mlp


def slot_prepack(layout: QuantLayout) -> Callable[[tuple[torch.Tensor, ...]], FbgemmExpert]:
    """``f(views) -> FbgemmExpert`` for :class:`~expertcache.offload.views.SlotViews` (one expert's copy)."""
    return lambda views: prepack_expert(views, layout)


#: FBGEMM must beat torch's int4 kernel by this factor in :func:`probe` to be chosen. Its copies cost twice the int4
#: bytes per slot and 0.2-0.5 s an expert to make, and the probe's matrix stays in the last-level cache while a decode
#: streams every expert: on an Intel Xeon (AMX, 480 MiB L3) under the three AVX2 caps the probe timed FBGEMM 1.5-1.8×
#: faster, yet the 2-layer OLMoE-1B-7B decode at C = N ran between 8 % slower and 8 % faster on FBGEMM's copies
#: (1.25× against 1.36× bf16 at load 8-12, 1.40× against 1.30× at load 3.6). An AMD EPYC's AVX2 clears it (per
#: matrix, cold: torch's int4 kernel 0.77× bf16, FBGEMM 2.65×; BENCHMARKS.md "Which 4-bit kernel on which CPU").
PROBE_MARGIN = 2.0


#: the probe cycles through distinct copies of its matrix totalling at least this many int4 bytes (at most
#: :data:`PROBE_COPIES`), so that neither kernel times a matrix sitting in the core's own cache
PROBE_BYTES = 8 << 20
PROBE_COPIES = 8


def probe(layout: QuantLayout, *, rounds: int = 5, seconds: float = 0.004) -> dict[str, float]:
    """Seconds per one-token product of ``layout``'s gate_up matrix [2·Fp, D] (random codes and scales) with
    torch's int4 kernel and with FBGEMM's int8 copy, timed interleaved (``rounds``, each about ``seconds`` a kernel,
    cycling through copies of the matrix (:data:`PROBE_BYTES`); the fastest round of each, the thread's CPU time:
    the least disturbed by other work): {'int4pack': s, 'fbgemm': s}."""
    qm = layout.gate_up
    g = torch.Generator().manual_seed(0)
    copies = max(1, min(PROBE_COPIES, -(-PROBE_BYTES // (qm.n_pad * qm.k_pad // 2))))
    sz_shape, sz_dtype = qm.shapes()[1]
    sz = (torch.rand(sz_shape, generator=g) * 0.01).to(sz_dtype)
    w4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (qm.n_pad, qm.k_pad), dtype=torch.int32, generator=g), 1) for _ in range(copies)]
    fb = [_prepack(torch.randn(qm.n_pad, qm.k, generator=g) * 0.02) for _ in range(copies)]
    x = torch.randn(1, qm.k, generator=g).to(layout.dtype)
    rr = not fbgemm_vnni()
    turn = iter(range(1 << 62))
    calls = {"int4pack": lambda: qmm(x, w4[next(turn) % copies], sz, qm),
             "fbgemm": lambda: _linear(x.float(), fb[next(turn) % copies], rr)}
    for f in calls.values():
        _time(f, copies)
    reps = {k: max(copies, int(seconds / max(1e-6, _time(f, copies) / copies))) for k, f in calls.items()}
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            times[k].append(_time(f, reps[k]))
    return {k: min(v) for k, v in times.items()}


def _time(f: Callable, n: int) -> float:
    import time

    t0 = time.thread_time()
    for _ in range(n):
        f()
    return (time.thread_time() - t0) / n


def slot_kernel(layout: QuantLayout | None, device: torch.device | str = "cpu") -> str | None:
    """:func:`expert_kernel` of ``layout``, where it offers FBGEMM (not forced) decided by :func:`probe` once per
    process and capability: FBGEMM if it is at least :data:`PROBE_MARGIN` times faster than torch's int4 kernel
    on this CPU, else ``int4pack``; recorded with the times in ``quant.PROBED`` (the kernel line and ``describe()``
    report it)."""
    if layout is None:
        return None
    got = expert_kernel(layout.mode, device)
    if got == "fbgemm" and expert_kernel(layout.mode, device, probed=False) == "fbgemm" and \
            torch.backends.cpu.get_cpu_capability() not in PROBED and not _forced():
        t = probe(layout)
        got = "fbgemm" if t["int4pack"] >= PROBE_MARGIN * t["fbgemm"] else "int4pack"
        got = PROBED.setdefault(torch.backends.cpu.get_cpu_capability(), (got, t))[0]
    return got


def _forced() -> bool:
    import os

    return bool(os.environ.get(EXPERT_KERNEL_VAR, "").strip())


def slot_mlps(layout: QuantLayout, acts: list[Callable], device: torch.device | str = "cpu") -> list[Callable]:
    """Each MoE layer's expert MLP on ``layout``'s slots: :func:`~expertcache.offload.quant.quant_mlp` (the fused
    kernel on the slot's views), and where :func:`expert_kernel` chooses FBGEMM here, :func:`fbgemm_mlp` for an
    expert given as its :class:`FbgemmExpert` (the slots have copies only when every expert is resident:
    :class:`~expertcache.offload.views.SlotViews`)."""
    if slot_kernel(layout, device) != "fbgemm":
        return [q4moe.attach(quant_mlp(layout, act), layout, act) for act in acts]  # the fused one-token step
    out = []
    for act in acts:
        fb, fused = fbgemm_mlp(act), quant_mlp(layout, act)
        out.append(lambda x_TD, w, fb=fb, fused=fused: fb(x_TD, w) if isinstance(w, FbgemmExpert) else fused(x_TD, w))
    return out


def slot_copy_bytes(layout: QuantLayout | None, device: torch.device | str = "cpu") -> int:
    """Bytes each slot holds beside its expert's bytes where the experts run on FBGEMM (:func:`packed_bytes`), else
    0: the memory plan's per-slot term, counted where the plan keeps every expert resident (``plan_from``)."""
    if slot_kernel(layout, device) != "fbgemm":
        return 0
    return packed_bytes(layout)

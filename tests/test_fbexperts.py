"""int4 experts on FBGEMM (offload/fbexperts.py): the per-CPU choice, the unpacking of torch's int4 layout, the
product against a float computation of the dequantised expert, a refilled slot's copy, and the plan's bytes.

The reference is computed here: the expert's int4 codes, scales and zeros from ``quantize_codes`` (what the packing
wrote), dequantised and multiplied in float64. FBGEMM's product adds the int8 re-quantisation of each weight (at
most half a step of ``max|row| / 127``) and the activation's (8 or 7 bits per token), so it is compared with a
relative tolerance of a few per cent, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload.quant import (EXPERT_KERNEL_VAR, QuantLayout, choose_expert_kernel, expert_kernel,
                                       int4pack_codes, pack_expert, quantize_codes)

fbgemm = pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="torch without FBGEMM")


# -- the choice per CPU -------------------------------------------------------------------------------------


def test_the_choice_follows_the_cpu():
    x86 = ["none", "onednn", "x86", "fbgemm"]
    assert choose_expert_kernel("AVX2", x86) == "fbgemm"
    assert choose_expert_kernel("DEFAULT", x86) == "fbgemm"
    for cap in ("AVX512", "AVX512_BF16", "AVX512_VNNI", "avx512"):
        assert choose_expert_kernel(cap, x86) == "int4pack", cap
    assert choose_expert_kernel("DEFAULT", ["none", "qnnpack"]) == "int4pack"  # ARM: no FBGEMM
    assert choose_expert_kernel("AVX512", x86, "fbgemm") == "fbgemm"  # forced either way
    assert choose_expert_kernel("AVX2", x86, "int4pack") == "int4pack"
    with pytest.raises(ValueError, match=EXPERT_KERNEL_VAR):
        choose_expert_kernel("AVX2", x86, "int3")
    with pytest.raises(ValueError, match="no FBGEMM"):
        choose_expert_kernel("DEFAULT", ["none", "qnnpack"], "fbgemm")


@pytest.fixture
def unprobed(monkeypatch):
    """No timing recorded (quant.PROBED is per process): restored afterwards. And no numba for the q4x8 kernel,
    which an AVX2 CPU would otherwise run (tests/test_q4x8.py): FBGEMM is what is offered there without it."""
    from expertcache.offload import q4x8
    from expertcache.offload.quant import PROBED

    monkeypatch.setattr(q4x8, "available", lambda: False)

    saved = dict(PROBED)
    PROBED.clear()
    yield PROBED
    PROBED.clear()
    PROBED.update(saved)


@fbgemm
@pytest.mark.parametrize("cap, want", [("AVX2", "fbgemm"), ("AVX512", "int4pack"), ("AVX512_VNNI", "int4pack")])
def test_expert_kernel_reads_the_capability_and_the_variable(monkeypatch, unprobed, cap, want):
    monkeypatch.delenv(EXPERT_KERNEL_VAR, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap)
    assert expert_kernel("int4") == want
    assert expert_kernel("int8") == "int8pack" and expert_kernel(None) is None
    monkeypatch.setenv(EXPERT_KERNEL_VAR, "int4pack" if want == "fbgemm" else "fbgemm")
    assert expert_kernel("int4") != want
    monkeypatch.setenv(EXPERT_KERNEL_VAR, "fast")
    with pytest.raises(ValueError, match=EXPERT_KERNEL_VAR):
        expert_kernel("int4")


@fbgemm
@pytest.mark.parametrize("int4pack_s, want", [(3e-3, "fbgemm"), (1.7e-3, "int4pack"), (1e-3, "int4pack")])
def test_where_fbgemm_is_offered_a_timing_decides(monkeypatch, unprobed, int4pack_s, want):
    """An AVX2 CPU (mocked): the first int4 layout times both products once (fbexperts.probe, mocked here: FBGEMM
    1 ms) and FBGEMM is taken only at 2x faster; the choice is kept for the process, reported by expert_kernel
    and the kernel line with the times, and never overrides a forced kernel or an AVX-512 CPU."""
    import expertcache.offload.fbexperts as fbx
    from expertcache.offload.kernelnote import kernel_choice_line

    calls = []
    monkeypatch.setattr(fbx, "probe", lambda layout: calls.append(layout) or {"int4pack": int4pack_s, "fbgemm": 1e-3})
    monkeypatch.delenv(EXPERT_KERNEL_VAR, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    lay = QuantLayout("int4", 64, 48, 32, torch.bfloat16, kernel="cpu-avx2")
    assert fbx.slot_kernel(lay) == want and fbx.slot_kernel(lay) == want and len(calls) == 1
    assert expert_kernel("int4") == want
    assert (fbx.slot_copy_bytes(lay) > 0) == (want == "fbgemm")
    assert f"int4pack {int4pack_s * 1e6:.0f} us, FBGEMM 1000 us" in kernel_choice_line("int4", None)
    monkeypatch.setenv(EXPERT_KERNEL_VAR, "fbgemm")
    assert fbx.slot_kernel(lay) == "fbgemm"
    monkeypatch.delenv(EXPERT_KERNEL_VAR)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert fbx.slot_kernel(lay) == "int4pack" and len(calls) == 1


@fbgemm
def test_the_probe_times_both_products():
    from expertcache.offload.fbexperts import probe

    t = probe(QuantLayout("int4", 64, 48, 32, torch.bfloat16), rounds=1, seconds=1e-4)
    assert set(t) == {"int4pack", "fbgemm"} and all(v > 0 for v in t.values())


# -- the product ------------------------------------------------------------------------------------------------


def _expert(d: int, f: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * f, d, generator=g) * 0.05, torch.randn(d, f, generator=g) * 0.05


def _dequantised(w_NK: torch.Tensor, qm) -> torch.Tensor:
    """The matrix the int4 kernel multiplies by, from the codes the packing made (not from the packed bytes)."""
    w = F.pad(w_NK[None].float(), (0, qm.k_pad - w_NK.shape[1]), mode="replicate")[0]
    q, s, z = quantize_codes(w, "int4", qm.group, qm.sz_dtype, optimize=qm.optimize)
    s, z = s.double().repeat_interleave(qm.group, 1), z.double().repeat_interleave(qm.group, 1)
    return ((q.double() - 8) * s + z)[:, :w_NK.shape[1]]


@pytest.mark.parametrize("d, f", [(64, 48), (144, 104), (256, 128)])
def test_int4pack_codes_inverts_the_packing(d, f):
    lay = QuantLayout("int4", d, f, 32, torch.bfloat16)
    gu, dn = _expert(d, f, 1)
    views = lay.views(pack_expert(gu, dn, lay))
    gate, up = F.pad(gu[:f], (0, 0, 0, lay.f_pad - f)), F.pad(gu[f:], (0, 0, 0, lay.f_pad - f))
    for w, qm, packed in ((torch.cat([gate, up]), lay.gate_up, views[0]), (dn, lay.down, views[2])):
        w = F.pad(w[None], (0, qm.k_pad - w.shape[1]), mode="replicate")[0]
        q, _, _ = quantize_codes(w, "int4", qm.group, qm.sz_dtype)
        got = int4pack_codes(packed, qm)
        assert torch.equal(got[:qm.n].int(), q)


@fbgemm
@pytest.mark.parametrize("reduce_range", [False, True])
@pytest.mark.parametrize("d, f, rows", [(64, 48, 1), (144, 104, 1), (144, 104, 5)])
def test_the_fbgemm_product_is_the_dequantised_expert_s(d, f, rows, reduce_range):
    from expertcache.offload.fbexperts import FbgemmExpert, fbgemm_mlp, prepack_expert
    from expertcache.offload.quant import fbgemm_vnni

    if not reduce_range and not fbgemm_vnni():
        pytest.skip("8-bit activations need FBGEMM's VNNI kernels (AVX2 sums u8 x s8 pairs in int16)")
    lay = QuantLayout("int4", d, f, 32, torch.bfloat16)
    gu, dn = _expert(d, f, 2)
    w = prepack_expert(lay.views(pack_expert(gu, dn, lay)), lay)
    assert isinstance(w, FbgemmExpert)
    gate_pad = F.pad(gu[:f], (0, 0, 0, lay.f_pad - f))
    up_pad = F.pad(gu[f:], (0, 0, 0, lay.f_pad - f))
    w_gu = _dequantised(torch.cat([gate_pad, up_pad]), lay.gate_up)
    w_dn = _dequantised(dn, lay.down)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(3)) * torch.tensor([1.0, 10.0, 0.1, 3.0, 1.0])[:rows, None]
    g, u = (x.double() @ w_gu.T).chunk(2, dim=-1)
    ref = (F.silu(g) * u)[:, :f] @ w_dn.T  # the padded rows of gate and up give exact zeros
    got = fbgemm_mlp(F.silu, reduce_range=reduce_range)(x.bfloat16(), w)
    assert got.shape == (rows, d) and got.dtype == torch.bfloat16
    for r in range(rows):  # each token's own scale: a row 100x smaller keeps its precision
        err = (got[r].double() - ref[r]).norm() / ref[r].norm()
        assert err < 0.05, (r, float(err))  # measured 0.5-3 %; a wrong weight or scale gives ~100 %


# -- in the runtime: a refilled slot, the plan -------------------------------------------------------------


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    from expertcache.models.tiny import save_tiny

    return save_tiny("olmoe", tmp_path_factory.mktemp("fbx") / "olmoe", seed=5)


def _runtime(olmoe, tmp_path, monkeypatch, kernel: str, **kw):
    from expertcache.offload import OffloadConfig, OffloadedModel

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(EXPERT_KERNEL_VAR, kernel)
    return OffloadedModel.from_pretrained(olmoe, OffloadConfig(quant="int4", io="cached", readers=0, **kw))


@fbgemm
def test_a_refilled_slot_computes_its_new_expert(olmoe, tmp_path, monkeypatch):
    """Every expert resident (C = N): each slot's expert computed from its FBGEMM copy. Reading expert b into a's
    slot (as a miss does) gives b's output there, not the copy made of a."""
    from expertcache.offload.fbexperts import FbgemmExpert

    rt = _runtime(olmoe, tmp_path, monkeypatch, "fbgemm")
    rt.warm(range(rt.num_experts))
    st = rt.states[0]
    a, b = 0, 1
    sa, sb = st.pool.slot_of[a], st.pool.slot_of[b]
    x = torch.randn(1, rt.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(rt.dtype)
    wa = rt.views.weights(st.moe.index, a, sa)
    assert isinstance(wa, FbgemmExpert)
    ya, yb = st.mlp(x, wa), st.mlp(x, rt.views.weights(st.moe.index, b, sb))
    assert not torch.allclose(ya, yb)
    rt.reads.wait(rt.reads.submit(st, b, sa))  # slot a now holds b's bytes
    w = rt.views.weights(st.moe.index, b, sa)
    assert isinstance(w, FbgemmExpert) and w is not wa
    assert torch.equal(st.mlp(x, w), yb)
    rt.close()


@fbgemm
def test_the_plan_counts_each_slot_s_fbgemm_copy(olmoe, tmp_path, monkeypatch):
    """C = N on FBGEMM: every slot (L·N cache slots, the scratch one and the spares) costs its int4 bytes plus the
    copy's int8 codes of both matrices and FBGEMM's per-column terms; with C < N no copy is made or counted."""
    plain = _runtime(olmoe, tmp_path, monkeypatch, "int4pack")
    fb = _runtime(olmoe, tmp_path, monkeypatch, "fbgemm")
    lay = fb.source.quant
    copy = 2 * lay.f_pad * lay.d + lay.d * lay.f_pad + 20 * (2 * lay.f_pad + lay.d)
    slots = len(fb.layers) * fb.num_experts + 1 + fb.offload.prefetch
    assert fb.plan.slots == plain.plan.slots == fb.num_experts
    assert fb.plan.slot_bytes == plain.plan.slot_bytes + copy
    assert fb.plan.total == plain.plan.total + slots * copy
    assert fb.views.prepack is not None and plain.views.prepack is None
    half = _runtime(olmoe, tmp_path, monkeypatch, "fbgemm", capacity=fb.num_experts // 2)
    assert half.plan.slot_bytes == plain.plan.slot_bytes and half.views.prepack is None
    tight = _runtime(olmoe, tmp_path, monkeypatch, "fbgemm", memory=str(plain.plan.total))  # no room for copies
    assert tight.plan.slots == fb.num_experts and tight.plan.slot_bytes == plain.plan.slot_bytes
    assert tight.views.prepack is None
    for rt in (plain, fb, half, tight):
        rt.close()

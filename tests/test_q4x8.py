"""The q4x8 expert kernel (offload/q4x8.py): int8 activations per token × int4 weights in its own layout.

The references are computed here, independently of the kernel: the codes, scales and zeros from
``quant.quantize_codes`` (what the packing wrote), dequantised in float64 by plain torch, and x quantised to int8 by
hand (``a = max|x| / 127``, ``round(x / a)``). The kernel's result must equal ``(a·xq) @ ((q - 8)·s).T + xs @ z.T``
(xs: x's group sums; the zero term takes x itself) to float32 rounding, and ``x @ W.T`` within the activation's
rounding, at most ``a/2`` per element through ``|(q - 8)·s|``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload import q4x8
from expertcache.offload.quant import (EXPERT_KERNEL_VAR, QuantLayout, QuantMatrix, choose_expert_kernel, int4pack_codes,
                                       pack_expert, pack_matrix, qmm, quant_mlp, quantize_codes)

needs_numba = pytest.mark.skipif(not q4x8.available(), reason="q4x8 needs numba")
needs_avx2 = pytest.mark.skipif(not q4x8.use_avx2(), reason="the intrinsic path needs an AVX2 CPU")


def _matrix(n, k, group, dtype=torch.bfloat16, seed=0, n_pad=None):
    """(w float32 [n, k], its q4x8 QuantMatrix, weight, scales, codes [n_pad, k_pad], s, z [n_pad, k_pad/G])."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    qm = QuantMatrix("int4", q4x8.KERNEL, n, k, group, dtype)
    weight, scales = pack_matrix(w, qm)
    wp = F.pad(w[None], (0, qm.k_pad - k), mode="replicate")[0]  # what pack_matrix quantises (quant.py)
    q, s, z = quantize_codes(wp, "int4", group, dtype)
    pad = qm.n_pad - n
    q, s, z = (F.pad(t, (0, 0, 0, pad)) for t in (q, s, z))
    return w, qm, weight, scales, q, s.double(), z.double()


def _by_hand(x, q, s, z, group):
    """(the hybrid reference (a·xq) @ ((q-8)s).T + xs @ z.T, x @ Wdeq.T, the rounding bound per output, the sum of
    the terms' magnitudes) in float64;
    x [M, K'] zero-padded to K."""
    n, k = q.shape
    x = F.pad(x.double(), (0, k - x.shape[1]))
    a = x.abs().amax(1, keepdim=True) / 127
    a = torch.where(a > 0, a, torch.ones_like(a))
    xq = torch.round((x.float() / a.float())).clamp(-127, 127).double()  # float32 division, as the kernel
    wq = ((q.double() - 8).view(n, -1, group) * s[..., None]).view(n, k)
    wz = (z[..., None].expand(n, k // group, group)).reshape(n, k)
    xs = x.view(x.shape[0], -1, group).sum(-1)
    hybrid = (a * xq) @ wq.T + xs @ z.T
    exact = x @ (wq + wz).T
    bound = (a / 2) @ wq.abs().sum(1, keepdim=True).T
    mag = (a * xq).abs() @ wq.abs().T + xs.abs() @ z.abs().T  # float32 rounding is relative to this
    return hybrid, exact, bound, mag


@pytest.mark.parametrize("n, k, group", [(64, 128, 32), (48, 144, 32), (104, 104, 32), (32, 256, 64),
                                          (16, 512, 128), (16, 512, 256)])
def test_packing_round_trip_gives_the_codes_back(n, k, group):
    w, qm, weight, scales, q, s, z = _matrix(n, k, group)
    assert weight.shape == (qm.n_pad, qm.k_pad // 2) and weight.dtype == torch.uint8
    assert scales.shape == (qm.n_pad, qm.k_pad // group, 2)
    assert torch.equal(q4x8.unpack_codes(weight).int(), q)
    assert torch.equal(int4pack_codes(weight, qm).int(), q)  # what fbexperts.dequantize reads, for either layout
    assert torch.equal(scales[..., 0].double(), s) and torch.equal(scales[..., 1].double(), z)
    # the layout: byte j of each 32-code block holds code j (low nibble) and code j + 16 (high)
    assert torch.equal(weight[:, 3] & 15, q[:, 3].to(torch.uint8)) and torch.equal(weight[:, 3] >> 4,
                                                                                  q[:, 19].to(torch.uint8))
    # the same bytes as torch's int4 layout: the memory plan and the reads do not change
    assert sum(qm.part_bytes()) == sum(QuantMatrix("int4", "cpu-x", n, k, group, torch.bfloat16).part_bytes())


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, k, group", [(64, 128, 32), (50, 144, 32), (104, 104, 32), (40, 256, 64),
                                          (16, 512, 128), (24, 512, 256)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_the_product_is_the_int8_activation_times_the_dequantised_weight(n, k, group, rows, dtype):
    w, qm, weight, scales, q, s, z = _matrix(n, k, group, dtype, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows)).to(dtype)
    x[rows // 2] = 0  # a row of zeros: 0 out
    hybrid, exact, bound, mag = _by_hand(x, q, s, z, group)
    for avx2 in ((False, True) if q4x8.use_avx2() else (False,)):
        got = q4x8.q4x8_mm(x, weight, scales, group, n, avx2=avx2)
        assert got.shape == (rows, n) and got.dtype == dtype
        got32 = q4x8.q4x8_mm(x.float(), weight, scales, group, n, avx2=avx2).double()
        assert ((got32 - hybrid[:, :n]).abs() <= 1e-5 * mag[:, :n] + 1e-9).all()
        assert ((got32 - exact[:, :n]).abs() <= bound[:, :n] * 1.001 + 1e-5).all()
        assert (got32[rows // 2] == 0).all()
        assert torch.equal(got, got32.float().to(dtype))  # float32 sums rounded once to x's dtype, as torch does
    assert torch.equal(qmm(x, weight, scales, qm), q4x8.q4x8_mm(x, weight, scales, group, n))  # the quant.py seam


@needs_numba
@needs_avx2
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_the_intrinsic_and_the_plain_path_give_the_same_integer_sums(group):
    _, qm, weight, scales, q, _, _ = _matrix(32, 4 * group, group, seed=group)
    x = torch.randn(5, 4 * group, generator=torch.Generator().manual_seed(1))
    x[0, :group] = torch.linspace(-1, 1, group)  # codes 0..15 against ±127: the extremes of the int16 sums
    avx2 = q4x8.int_dots(x, weight, group, avx2=True)
    plain = q4x8.int_dots(x, weight, group, avx2=False)
    assert avx2.shape == (5, 32, 4) and torch.equal(avx2, plain)
    a = x.abs().amax(1, keepdim=True) / 127
    xq = torch.round(x / a).int()
    by_hand = (xq.view(5, 1, 4, group) * q.view(1, 32, 4, group)).sum(-1)  # Σ q·xq per group, by hand
    assert torch.equal(avx2, by_hand.int())
    y_avx2 = q4x8.q4x8_mm(x, weight, scales, group, avx2=True)
    y_plain = q4x8.q4x8_mm(x, weight, scales, group, avx2=False)  # the same sums, floats summed in another order
    torch.testing.assert_close(y_avx2, y_plain, rtol=1e-5, atol=1e-6)


@needs_numba
@pytest.mark.parametrize("d, f, group", [(144, 104, 32), (128, 64, 64)])
def test_the_expert_mlp_matches_torch_s_int4_kernel(d, f, group):
    """The whole expert (gate_up, act(gate)·up, down) on q4x8 slot views against quant_mlp on torch's int4 layout
    of the same weights: the same codes, so only the activations' int8 rounding differs."""
    g = torch.Generator().manual_seed(7)
    gu, dn = torch.randn(2 * f, d, generator=g) * 0.05, torch.randn(d, f, generator=g) * 0.05
    x = torch.randn(3, d, generator=g).bfloat16()
    out = {}
    for kernel in (q4x8.KERNEL, ""):
        lay = QuantLayout("int4", d, f, group, torch.bfloat16, kernel=kernel)
        out[kernel or "int4pack"] = quant_mlp(lay, F.silu)(x, lay.views(pack_expert(gu, dn, lay)))
    assert out["q4x8"].dtype == torch.bfloat16 and out["q4x8"].shape == (3, d)
    rel = ((out["q4x8"].float() - out["int4pack"].float()).norm() / out["int4pack"].float().norm()).item()
    assert rel < 0.03, rel


def test_the_choice_per_cpu_and_numba():
    x86, arm = ["none", "onednn", "x86", "fbgemm"], ["none", "qnnpack"]
    assert choose_expert_kernel("AVX2", x86, numba=True) == "q4x8"
    assert choose_expert_kernel("AVX2", x86, numba=False) == "fbgemm"  # as before: FBGEMM where the probe says
    for cap in ("AVX512", "AVX512_VNNI", "AVX512_BF16"):
        assert choose_expert_kernel(cap, x86, numba=True) == "int4pack"  # torch's threads: its kernel uses them
        assert choose_expert_kernel(cap, x86, numba=True, one_thread=True) == "q4x8"
        assert choose_expert_kernel(cap, x86, numba=False, one_thread=True) == "int4pack"
        assert choose_expert_kernel(cap, arm, numba=True, one_thread=True) == "int4pack"
    assert choose_expert_kernel("AVX2", x86, numba=True, one_thread=True) == "q4x8"
    assert choose_expert_kernel("DEFAULT", x86, numba=True) == "fbgemm"  # x86 without AVX2
    assert choose_expert_kernel("DEFAULT", arm, numba=True) == "int4pack"  # ARM
    assert choose_expert_kernel("AVX512", x86, "q4x8", numba=True) == "q4x8"  # forced wins
    assert choose_expert_kernel("DEFAULT", arm, "q4x8", numba=True) == "q4x8"
    assert choose_expert_kernel("AVX2", x86, "int4pack", numba=True) == "int4pack"
    assert choose_expert_kernel("AVX2", x86, "fbgemm", numba=True) == "fbgemm"
    with pytest.raises(ValueError, match="numba"):
        choose_expert_kernel("AVX2", x86, "q4x8", numba=False)
    with pytest.raises(ValueError, match="int4pack, fbgemm, q4x8"):
        choose_expert_kernel("AVX2", x86, "q8x8", numba=True)


def test_expert_kernel_and_layout_follow_the_capability(monkeypatch):
    from expertcache.offload.kernelnote import kernel_choice_line
    from expertcache.offload.quant import expert_kernel, expert_layout_kernel

    monkeypatch.delenv(EXPERT_KERNEL_VAR, raising=False)
    monkeypatch.setattr(q4x8, "available", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert expert_kernel("int4") == "q4x8" and expert_layout_kernel("int4") == "q4x8"
    assert expert_layout_kernel("int8") == "plain" and expert_kernel("int8") == "int8pack"
    assert "q4x8 (numba, int8 activations per token" in kernel_choice_line("int4", None)
    monkeypatch.setattr(q4x8, "available", lambda: False)
    assert expert_kernel("int4", probed=False) == "fbgemm" and expert_layout_kernel("int4") == "cpu-avx2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(q4x8, "available", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert expert_kernel("int4") == "int4pack" and expert_layout_kernel("int4") == "cpu-avx512"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one thread: q4x8 on AVX-512 too
    assert expert_kernel("int4") == "q4x8" and expert_layout_kernel("int4") == "q4x8"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv(EXPERT_KERNEL_VAR, "q4x8")
    assert expert_kernel("int4") == "q4x8" and expert_layout_kernel("int4") == "q4x8"
    assert expert_layout_kernel("int4", "cuda") == "cuda"


def test_no_numba_means_no_q4x8(monkeypatch):
    """EXPERTCACHE_NO_NUMBA=1: not offered, and forcing it is one error naming the variable."""
    import subprocess
    import sys

    code = ("import torch; from expertcache.offload import q4x8, quant; assert not q4x8.available(); "
            "torch.backends.cpu.get_cpu_capability = lambda: 'AVX2'; "
            "assert quant.expert_kernel('int4', probed=False) == 'fbgemm'; import os; "
            "os.environ['EXPERTCACHE_EXPERT_KERNEL'] = 'q4x8'\n"
            "try:\n    quant.expert_kernel('int4')\nexcept ValueError as e:\n    print(e)")
    import os
    env = dict(os.environ, EXPERTCACHE_NO_NUMBA="1")
    env.pop(EXPERT_KERNEL_VAR, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "EXPERTCACHE_EXPERT_KERNEL=q4x8 needs numba" in out.stdout


@pytest.fixture(scope="module")
def tiny_olmoe(tmp_path_factory):
    from expertcache.models.tiny import save_tiny

    return save_tiny("olmoe", tmp_path_factory.mktemp("q4x8") / "olmoe", seed=3)


@needs_numba
def test_an_offloaded_model_decodes_on_q4x8_close_to_int4pack(tiny_olmoe, tmp_path, monkeypatch):
    """The tiny OLMoE offloaded with int4 experts, prefill then one-token decode at C = 2 and C = N: q4x8's logits
    close to torch's int4 kernel's (the same codes; the activations' int8 rounding apart), from its own sidecar."""
    from conftest import decode_logits

    from expertcache.offload import OffloadConfig, OffloadedModel

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    out, files = {}, {}
    warmed = []
    monkeypatch.setattr(q4x8, "warm", lambda: warmed.append(True))  # compiled before the plan (preflight)
    for kernel in ("int4pack", "q4x8"):
        monkeypatch.setenv(EXPERT_KERNEL_VAR, kernel)
        rt = OffloadedModel.from_pretrained(tiny_olmoe, OffloadConfig(quant="int4", io="cached", readers=0,
                                                                      capacity=2), dtype=torch.float32)
        assert (rt.source.quant.kernel == "q4x8") == (kernel == "q4x8")
        assert len(warmed) == (kernel == "q4x8")
        files[kernel] = rt.source.path
        out[kernel] = [decode_logits(rt, ids, prefill=3)]
        rt.configure(capacity=rt.num_experts)
        out[kernel].append(decode_logits(rt, ids, prefill=3))
        rt.close()
    assert files["q4x8"] != files["int4pack"] and "q4x8" in files["q4x8"].name
    assert files["q4x8"].is_file() and files["int4pack"].is_file()
    for a, b in zip(out["q4x8"], out["int4pack"]):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 0.02, rel
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


@needs_numba
def test_shapes_the_kernel_cannot_take_are_refused():
    _, qm, weight, scales, *_ = _matrix(32, 128, 32)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="do not fit"):
        q4x8.q4x8_mm(torch.randn(2, 160), weight, scales, 32)  # x wider than K
    with pytest.raises(ValueError, match="do not fit"):
        q4x8.q4x8_mm(x, weight, scales, 64)  # scales of another group
    with pytest.raises(ValueError, match="do not fit"):
        q4x8.q4x8_mm(x, weight[:30], scales[:30], 32)  # rows not a multiple of 4
    with pytest.raises(ValueError, match="contiguous"):
        q4x8.q4x8_mm(x, weight.t().contiguous().t(), scales, 32)
    assert q4x8.q4x8_mm(torch.randn(0, 128), weight, scales, 32).shape == (0, 32)  # no tokens: nothing

"""The fused one-token MoE step on q4x8 int4 experts (offload/q4moe.py).

The reference is computed here, independently of the kernel: the codes unpacked from the experts' bytes and their
stored scales and zeros dequantised by plain torch in float64; x quantised to int8 by hand once (``a = max|x| / 127``,
``round(x / a)``), each gate_up product ``(a·xq) @ ((q - 8)·s).T + xs @ z.T`` (xs: x's group sums) in float64 then
float32, ``silu(gate) * up`` in float32, quantised the same way for the down product, and the weighted sum in
ascending expert id. The kernel must equal it to float32 rounding (then one rounding to x's dtype), and the per-expert
path (``quant.quant_mlp`` + the step's combine in x's dtype) within that path's roundings to x's dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload import q4moe, q4x8
from expertcache.offload.quant import EXPERT_KERNEL_VAR, QuantLayout, pack_expert, quant_mlp

needs_numba = pytest.mark.skipif(not q4x8.available(), reason="the fused kernel needs numba")
needs_avx2 = pytest.mark.skipif(not q4x8.use_avx2(), reason="the intrinsic path needs an AVX2 CPU")

#: (D, F, G): no padding; K padding of gate_up (D % G), F padding (F % G) and down's N padding (D % 16) together
SHAPES = [(128, 64, 64), (150, 100, 32), (200, 72, 64)]


def _experts(d, f, group, u, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = QuantLayout("int4", d, f, group, dtype, kernel=q4x8.KERNEL)
    blobs = [pack_expert(torch.randn(2 * f, d, generator=g) * 0.05, torch.randn(d, f, generator=g) * 0.05, lay)
             for _ in range(u)]
    x = torch.randn(d, generator=g).to(dtype)
    w = (torch.rand(u, generator=g) + 0.1).tolist()
    return lay, blobs, [lay.views(b) for b in blobs], x, w


def _quant(v, k_pad):
    """(a, xq, v zero-padded) of a float32 vector, as the contract says (float32 division, half to even)."""
    v = F.pad(v.float(), (0, k_pad - v.numel()))
    big = v.abs().max()
    a = big / 127 if big > 0 else torch.tensor(1.0)
    return a, torch.round(v / a).clamp(-127, 127), v


def _product(v, codes, sz, group, rows):
    """The hybrid product (a·xq) @ ((q - 8)·s).T + xs @ z.T of rows [0, rows) in float64, then float32."""
    k_pad = codes.shape[1] * 2
    a, xq, vp = _quant(v, k_pad)
    q = q4x8.unpack_codes(codes[:rows]).double()
    s, z = sz[:rows, :, 0].double(), sz[:rows, :, 1].double()
    wq = ((q - 8).view(rows, -1, group) * s[..., None]).view(rows, k_pad)
    xs = vp.double().view(-1, group).sum(-1)
    return (a.double() * xq.double() @ wq.T + z @ xs).float()


def _by_hand(lay, views, x, w):
    out = torch.zeros(lay.d, dtype=torch.float32)
    for (gc, gs, dc, ds), wu in zip(views, w):
        gu = _product(x, gc, gs, lay.group, 2 * lay.f_pad)
        h = F.silu(gu[:lay.f_pad]) * gu[lay.f_pad:]
        out += torch.tensor(wu, dtype=torch.float32) * _product(h, dc, ds, lay.group, lay.d)
    return out


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d, f, group", SHAPES)
@pytest.mark.parametrize("u", [1, 2, 5, 8])
def test_the_fused_step_is_the_contract_by_hand_and_the_per_expert_path(d, f, group, u, dtype):
    lay, _, views, x, w = _experts(d, f, group, u, dtype, seed=d + u)
    got = q4moe.fused_moe(x, views, w, d, lay.f_pad, group, threads=1)
    assert got.dtype == dtype and got.shape == (d,)
    ref = _by_hand(lay, views, x, w)
    # float32 rounding, then one rounding to x's dtype (half an ulp of it)
    ulp = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    tol = ref.abs() * ulp + ref.abs().max() * 1e-4
    assert ((got.float() - ref).abs() <= tol).all(), (got.float() - ref).abs().max()
    # the per-expert path: quant_mlp per expert, weighted and summed in x's dtype (step.py's combine)
    mlp = quant_mlp(lay, F.silu)
    per = torch.zeros(d, dtype=dtype)
    for v, wu in zip(views, w):
        per.add_((mlp(x[None], v)[0] * torch.tensor(wu)).to(dtype))
    rel = ((got.float() - per.float()).norm() / per.float().norm()).item()
    assert rel < {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1.5e-2}[dtype], rel


@needs_numba
@needs_avx2
@pytest.mark.parametrize("d, f, group", SHAPES)
def test_the_intrinsic_and_the_plain_path_agree(d, f, group):
    """The same integer sums (q4x8's two paths: tests/test_q4x8.py), the floats summed in another order."""
    lay, _, views, x, w = _experts(d, f, group, 4, torch.float32, seed=3)
    a = q4moe.fused_moe(x, views, w, d, lay.f_pad, group, threads=1, avx2=True)
    b = q4moe.fused_moe(x, views, w, d, lay.f_pad, group, threads=1, avx2=False)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("u", [1, 2, 3, 7, 8])
def test_threads_split_the_experts_and_give_the_one_thread_result_bit_for_bit(u, dtype):
    lay, _, views, x, w = _experts(150, 100, 32, u, dtype, seed=u)
    one = q4moe.fused_moe(x, views, w, 150, lay.f_pad, 32, threads=1)
    for n in (2, 3, 4):
        for _ in range(3):
            assert torch.equal(q4moe.fused_moe(x, views, w, 150, lay.f_pad, 32, threads=n), one)


@needs_numba
def test_a_zero_token_and_zero_weights_give_zeros():
    lay, _, views, x, w = _experts(128, 64, 64, 3, torch.bfloat16)
    assert torch.equal(q4moe.fused_moe(torch.zeros_like(x), views, w, 128, lay.f_pad, 64),
                       _by_hand(lay, views, torch.zeros_like(x), w).bfloat16())
    assert not q4moe.fused_moe(x, views, [0.0] * 3, 128, lay.f_pad, 64).any()


def test_the_switch_and_where_the_fused_step_applies(monkeypatch):
    lay = QuantLayout("int4", 128, 64, 64, torch.bfloat16, kernel=q4x8.KERNEL)
    assert q4moe.silu_gated(F.silu) and q4moe.silu_gated(torch.nn.SiLU()) and not q4moe.silu_gated(F.gelu)
    from transformers.activations import ACT2FN

    assert q4moe.silu_gated(ACT2FN["silu"]) and not q4moe.silu_gated(ACT2FN["gelu"])
    monkeypatch.delenv(q4moe.FUSED_VAR, raising=False)
    assert q4moe.enabled() == q4x8.available()
    assert hasattr(q4moe.attach(quant_mlp(lay, F.silu), lay, F.silu), "fused") == q4x8.available()
    assert not hasattr(q4moe.attach(quant_mlp(lay, F.gelu), lay, F.gelu), "fused")
    other = QuantLayout("int4", 128, 64, 64, torch.bfloat16, kernel="cpu-x")
    assert not hasattr(q4moe.attach(quant_mlp(other, F.silu), other, F.silu), "fused")
    monkeypatch.setenv(q4moe.FUSED_VAR, "0")
    assert not q4moe.enabled() and not hasattr(q4moe.attach(quant_mlp(lay, F.silu), lay, F.silu), "fused")
    monkeypatch.setenv(q4moe.FUSED_VAR, "yes")
    with pytest.raises(ValueError, match="EXPERTCACHE_FUSED_MOE must be 0 .* got 'yes'"):
        q4moe.enabled()


@pytest.fixture(scope="module")
def tiny_olmoe(tmp_path_factory):
    from expertcache.models.tiny import save_tiny

    return save_tiny("olmoe", tmp_path_factory.mktemp("q4moe") / "olmoe", seed=3)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_offloaded_model_decodes_with_the_fused_step_as_with_the_per_expert_one(tiny_olmoe, tmp_path, monkeypatch,
                                                                                   dtype):
    """The tiny OLMoE with int4 experts on q4x8, prefill then one-token decode at C = N (every step all hits: the
    fused call) and C = 2 (misses: the fused call where no slot is read twice): logits close to the per-expert
    path's ($EXPERTCACHE_FUSED_MOE=0), the same greedy tokens, and the fused call made once per MoE layer a token."""
    from conftest import decode_logits

    from expertcache.offload import OffloadConfig, OffloadedModel

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(EXPERT_KERNEL_VAR, "q4x8")
    calls = []
    real = q4moe.fused_moe
    monkeypatch.setattr(q4moe, "fused_moe", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    out = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(q4moe.FUSED_VAR, switch)
        rt = OffloadedModel.from_pretrained(tiny_olmoe, OffloadConfig(quant="int4", io="cached", readers=0,
                                                                      capacity=2), dtype=dtype)
        assert rt.source.quant.kernel == "q4x8"
        made = len(calls)
        out[switch] = [decode_logits(rt, ids, prefill=3)]
        rt.configure(capacity=rt.num_experts)
        out[switch].append(decode_logits(rt, ids, prefill=3))
        if switch == "1":  # readers=0: every one-token step reads no slot twice -> one call per layer per token
            assert len(calls) - made == 2 * 5 * len(rt.layers), (len(calls), made)
            assert all(n == rt.top_k for n in calls)
        else:
            assert len(calls) == made
        rt.close()
    for a, b in zip(out["1"], out["0"]):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < (1e-4 if dtype == torch.float32 else 3e-2), rel
        assert (a[:, 3:].argmax(-1) == b[:, 3:].argmax(-1)).float().mean() >= 0.8

"""The int8 dense product on the q8x8 kernel (offload/q8x8.py): int8 activations per block of 32 × int8 weights.

References are computed here, independently of the kernel: x quantised per block of 32 by hand in torch
(``a = max|x_b| / 127``, ``round(x / a)``), the integer sums in float64 by einsum, the codes and scales read from
the module's buffers. The product must equal ``s · Σ_b a_b · Σ q·xq`` to float32 rounding, and ``x @ (q·s).T`` within
the activation's rounding (at most ``a_b / 2`` per element of x through ``|q·s|``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload import q8x8
from expertcache.offload.qlinear import DENSE_INT8_KERNEL_VAR, QuantLinear, int8_kernel

needs_numba = pytest.mark.skipif(not q8x8.available(), reason="q8x8 needs numba")


def _by_hand(x_MK, q_NK, s_N):
    """(the contract's value in float64, x @ (q·s).T in float64, the activation-rounding bound per output)."""
    m, k_in = x_MK.shape
    n, k = q_NK.shape
    nb = -(-k // 32)
    x = F.pad(x_MK.double(), (0, nb * 32 - k_in)).view(m, nb, 32)
    a = x.abs().amax(-1) / 127
    a = torch.where(a > 0, a, torch.ones_like(a))
    xq = torch.round(x / a[..., None]).clamp(-127, 127)
    w = F.pad(q_NK.double(), (0, nb * 32 - k)).view(n, nb, 32)
    contract = torch.einsum("mbk,nbk->mnb", xq, w).mul(a[:, None, :]).sum(-1) * s_N.double()
    wq = w.reshape(n, -1) * s_N.double()[:, None]
    exact = x.reshape(m, -1) @ wq.T
    bound = (a[..., None].expand(m, nb, 32).reshape(m, -1) / 2) @ wq.abs().T
    return contract, exact, bound


@needs_numba
@pytest.mark.parametrize("avx2", [True, False])
@pytest.mark.parametrize("m, n, k, k_in", [(1, 64, 2048, 2048), (3, 37, 144, 144), (2, 8, 160, 150), (1, 5, 48, 40),
                                           (5, 4, 16, 16), (1, 9, 32, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_q8x8_is_the_block_quantised_activation_times_the_codes(m, n, k, k_in, dtype, avx2):
    """Rows not a multiple of 4 (37, 5, 9: the plain tail), K_pad a multiple of 16 not 32 (144, 16, 48), x shorter
    than K_pad (zeros), every dtype; the AVX2 path (where this CPU has it) and the plain one."""
    if avx2 and not q8x8.use_avx2():
        pytest.skip("no AVX2 here")
    torch.manual_seed(k + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = (torch.rand(n) * 0.01 + 1e-3).to(dtype)
    x = (torch.randn(m, k_in) * torch.linspace(0.1, 3, k_in)).to(dtype)
    x[0, : min(32, k_in)] = 0  # a block of zeros (a = 1, xq = 0)
    y = q8x8.q8x8_mm(x, q, s, avx2=avx2)
    assert y.dtype == dtype and y.shape == (m, n)
    contract, exact, bound = _by_hand(x.float(), q, s.float())
    out_tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    tol = 1e-5 * contract.abs().amax() + out_tol * contract.abs()
    assert ((y.double() - contract).abs() <= tol + 1e-6).all()
    assert ((y.double() - exact).abs() <= bound + tol + 1e-6).all()


@needs_numba
def test_the_two_paths_agree_to_float32_rounding_and_x_quantises_as_block_sums_says():
    """The same integer sums; the float sums over blocks in another order (eight lanes against one)."""
    if not q8x8.use_avx2():
        pytest.skip("no AVX2 here")
    torch.manual_seed(1)
    q = torch.randint(-127, 128, (44, 272), dtype=torch.int8)
    s = torch.rand(44) * 0.02
    x = torch.randn(6, 260)
    assert torch.allclose(q8x8.q8x8_mm(x, q, s, avx2=True), q8x8.q8x8_mm(x, q, s, avx2=False), rtol=1e-5, atol=1e-5)
    xq, a = q8x8.block_sums(x, 272)
    assert xq.shape == (6, 272) and a.shape == (6, 9) and xq.abs().max() <= 127
    assert torch.allclose((xq[:, :260].float().view(6, -1)), torch.round(x / a.repeat_interleave(32, 1)[:, :260]))


@needs_numba
def test_bad_shapes_are_refused():
    q = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="q8x8"):
        q8x8.q8x8_mm(torch.zeros(1, 65), q, torch.ones(8))
    with pytest.raises(ValueError, match="q8x8"):
        q8x8.q8x8_mm(torch.zeros(1, 64), q.to(torch.uint8), torch.ones(8))
    with pytest.raises(ValueError, match="q8x8"):
        q8x8.q8x8_mm(torch.zeros(1, 64), q, torch.ones(7))


@needs_numba
@pytest.mark.parametrize("n, k, bias", [(100, 144, True), (50304 // 64, 256, False)])
def test_a_q8x8_quantlinear_is_the_contract_on_its_own_codes(n, k, bias, monkeypatch):
    """QuantLinear int8 with the kernel forced to q8x8: the codes packed as for FBGEMM / int8pack (the same
    buffer), the product the contract's on them (+ bias), leading dims kept."""
    monkeypatch.setenv(DENSE_INT8_KERNEL_VAR, "q8x8")
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=bias)
    ql = QuantLinear.from_linear(lin, "int8")
    assert ql.kernel == "q8x8" and ql.qweight.dtype == torch.int8
    monkeypatch.setenv(DENSE_INT8_KERNEL_VAR, "int8pack")
    ref_mod = QuantLinear.from_linear(lin, "int8")
    assert torch.equal(ql.qweight, ref_mod.qweight) and torch.equal(ql.scales, ref_mod.scales)
    x = torch.randn(2, 3, k)
    y = ql(x)
    assert y.shape == (2, 3, n)
    contract, _, _ = _by_hand(x.view(-1, k), ql.qweight, ql.scales.float())
    if bias:
        contract = contract + lin.bias.detach().double()
    assert torch.allclose(y.view(-1, n).double(), contract, rtol=1e-5, atol=1e-6)
    # against the float layer: within the activation's and the weight's rounding (loose, a sanity check)
    rel = (y - lin(x)).norm() / lin(x).norm()
    assert rel < 0.02


def test_the_int8_kernel_choice(monkeypatch):
    """Forced by the variable (bad value / q8x8 without numba: ValueError naming it); GPUs and --compile take
    int8pack whatever is set; unforced, the int8 dense part and the weight-only lm_head of int4-head8 take q8x8
    where AVX2 and numba are and FBGEMM has no VNNI, else FBGEMM (where torch has it) and int8pack."""
    from expertcache.offload.quant import dense_int8_kernel, fbgemm_vnni

    monkeypatch.delenv(DENSE_INT8_KERNEL_VAR, raising=False)
    here = q8x8.available() and q8x8.use_avx2() and not fbgemm_vnni()
    assert int8_kernel("cpu") == ("q8x8" if here else dense_int8_kernel("cpu"))
    assert int8_kernel("cpu", weight_only=True) == ("q8x8" if here else "int8pack")
    assert int8_kernel("cpu", compiled=True) == "int8pack" == int8_kernel("cuda")
    monkeypatch.setenv(DENSE_INT8_KERNEL_VAR, "int8pack")
    assert int8_kernel("cpu") == "int8pack" and int8_kernel("cpu", weight_only=True) == "int8pack"
    monkeypatch.setenv(DENSE_INT8_KERNEL_VAR, "bogus")
    with pytest.raises(ValueError, match=f"{DENSE_INT8_KERNEL_VAR}.*bogus"):
        int8_kernel("cpu")
    if not q8x8.available():
        monkeypatch.setenv(DENSE_INT8_KERNEL_VAR, "q8x8")
        with pytest.raises(ValueError, match="needs numba"):
            int8_kernel("cpu")


@needs_numba
def test_q4m_runs_its_lm_head_on_the_chosen_kernel_and_the_plan_counts_no_fbgemm_copy(monkeypatch):
    """A tiny OLMoE with --quant q4m: its lm_head's QuantLinear takes int8_kernel(weight_only=True)'s choice, is not
    among the FBGEMM shapes the plan adds a packing transient for, and its logits stay near the int8pack run's."""
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.qlinear import fbgemm_shapes

    logits = {}
    for forced in ("q8x8", "int8pack"):
        monkeypatch.setenv(DENSE_INT8_KERNEL_VAR, forced)
        rt = OffloadedModel.from_pretrained("granular", OffloadConfig(tier="host", quant="q4m", context=32))
        head = rt.model.get_output_embeddings()
        assert isinstance(head, QuantLinear) and head.kernel == forced
        assert all(n != head.out_features or k != head.in_features for n, k, _ in
                   fbgemm_shapes(rt.model, "int4-head8", "cpu"))
        with torch.inference_mode():
            logits[forced] = rt.forward(torch.tensor([[5, 17, 301, 44, 9, 12]])).logits.float()
        rt.close()
    ref = logits["int8pack"]
    assert ((logits["q8x8"] - ref).norm() / ref.norm()) < 0.01
    assert (logits["q8x8"].argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8

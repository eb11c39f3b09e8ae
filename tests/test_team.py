"""Our kernels on a team of threads (offload/team.py): the fused MoE step (q4moe.py) and the q8x8 product (q8x8.py)
split over 2-4 threads give the one-thread result bit for bit, on torch's OpenMP team and on the fallback pool of
Python threads, and stay the contract's value computed independently here in plain torch (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload import q4moe, q4x8, q8x8, team
from expertcache.offload.quant import QuantLayout, pack_expert

needs_numba = pytest.mark.skipif(not q4x8.available(), reason="the kernels need numba")


@pytest.fixture(params=["openmp", "pool"])
def where(request, monkeypatch):
    """Each test on torch's OpenMP team (where this torch has one) and on the fallback pool."""
    if request.param == "pool":
        monkeypatch.setattr(team, "_LIB", [None])
    elif team.runtime() is None:
        pytest.skip("torch's intra-op threads are not on a loaded OpenMP runtime here")
    return request.param


def test_torch_openmp_runtime_is_found_where_torch_runs_on_openmp():
    """On Linux with torch's OpenMP backend the library is found, and it holds torch's thread count."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info() or not team._loaded_libraries():
        pytest.skip("torch's intra-op threads are not OpenMP here")
    lib = team.runtime()
    assert lib is not None
    before = torch.get_num_threads()
    try:
        for n in (1, 3, 2):
            torch.set_num_threads(n)
            assert lib.omp_get_max_threads() == n
    finally:
        torch.set_num_threads(before)


def test_cut():
    assert [team.cut(u, 2) for u in (0, 1, 2, 8)] == [1, 1, 2, 2] and team.cut(3, 8) == 3


def _q8_by_hand(x_MK, q_NK, s_N):
    """The q8x8 contract: x per block of 32 to int8 in float32 (a = max|x_b| / 127, xq = round(x / a): the
    kernel's roundings, ties included), then Σ_b a_b·Σ q·xq times s in float64."""
    m, k_in = x_MK.shape
    n, k = q_NK.shape
    nb = -(-k // 32)
    x = F.pad(x_MK.float(), (0, nb * 32 - k_in)).view(m, nb, 32)
    a = x.abs().amax(-1) / 127
    a = torch.where(a > 0, a, torch.ones_like(a))
    xq = torch.round(x / a[..., None]).clamp(-127, 127).double()
    w = F.pad(q_NK.double(), (0, nb * 32 - k)).view(n, nb, 32)
    return torch.einsum("mbk,nbk->mnb", xq, w).mul(a.double()[:, None, :]).sum(-1) * s_N.double()


@needs_numba
@pytest.mark.parametrize("avx2", [True, False])
@pytest.mark.parametrize("m, n, k, k_in", [(1, 301, 272, 260), (2, 130, 64, 64), (1, 3, 48, 40), (1, 1000, 2048, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8x8_on_threads_is_the_one_thread_result_bit_for_bit(where, m, n, k, k_in, dtype, avx2):
    """N past several CHUNKs and not a multiple of 4 (the plain tail rows), K_pad ≡ 16 mod 32 (a half block),
    fewer rows than a CHUNK (one unit for 2 threads)."""
    if avx2 and not q8x8.use_avx2():
        pytest.skip("no AVX2 here")
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = (torch.rand(n, generator=g) * 0.01 + 1e-3).to(dtype)
    x = (torch.randn(m, k_in, generator=g) * 2).to(dtype)
    one = q8x8.q8x8_mm(x, q, s, avx2=avx2, threads=1)
    ref = _q8_by_hand(x.float(), q, s.float())
    tol = 1e-5 * ref.abs().amax() + {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype] * ref.abs()
    assert ((one.double() - ref).abs() <= tol + 1e-6).all()
    for threads in (2, 3, 4):
        for _ in range(3):
            assert torch.equal(q8x8.q8x8_mm(x, q, s, avx2=avx2, threads=threads), one)


def _q4_by_hand(lay, views, x, w):
    """The fused step's contract in float64/float32 (tests/test_q4moe.py's reference, restated): x quantised once
    per token (a = max|x| / 127) for gate_up, silu(gate)·up quantised the same way for down, summed in ascending u."""
    def product(v, codes, sz, rows):
        k_pad = codes.shape[1] * 2
        v = F.pad(v.float(), (0, k_pad - v.numel()))
        big = v.abs().max()
        a = big / 127 if big > 0 else torch.tensor(1.0)
        xq = torch.round(v / a).clamp(-127, 127)
        qc = q4x8.unpack_codes(codes[:rows]).double()
        sc, z = sz[:rows, :, 0].double(), sz[:rows, :, 1].double()
        wq = ((qc - 8).view(rows, -1, lay.group) * sc[..., None]).view(rows, k_pad)
        return (a.double() * xq.double() @ wq.T + z @ v.double().view(-1, lay.group).sum(-1)).float()

    out = torch.zeros(lay.d, dtype=torch.float32)
    for (gc, gs, dc, ds), wu in zip(views, w):
        gu = product(x, gc, gs, 2 * lay.f_pad)
        out += torch.tensor(wu, dtype=torch.float32) * product(F.silu(gu[:lay.f_pad]) * gu[lay.f_pad:], dc, ds,
                                                               lay.d)
    return out


@needs_numba
@pytest.mark.parametrize("avx2", [True, False])
@pytest.mark.parametrize("u", [1, 2, 3, 8])
def test_the_fused_moe_on_threads_is_the_one_thread_result_bit_for_bit(where, u, avx2):
    if avx2 and not q4x8.use_avx2():
        pytest.skip("no AVX2 here")
    d, f, group = 200, 72, 64
    g = torch.Generator().manual_seed(u)
    lay = QuantLayout("int4", d, f, group, torch.bfloat16, kernel=q4x8.KERNEL)
    views = [lay.views(pack_expert(torch.randn(2 * f, d, generator=g) * 0.05, torch.randn(d, f, generator=g) * 0.05,
                                   lay)) for _ in range(u)]
    x = torch.randn(d, generator=g).bfloat16()
    w = (torch.rand(u, generator=g) + 0.1).tolist()
    one = q4moe.fused_moe(x, views, w, d, lay.f_pad, group, threads=1, avx2=avx2)
    ref = _q4_by_hand(lay, views, x, w)
    assert ((one.float() - ref).abs() <= ref.abs() * 2 ** -8 + ref.abs().max() * 1e-4).all()
    for threads in (2, 3, 4):
        for _ in range(3):
            assert torch.equal(q4moe.fused_moe(x, views, w, d, lay.f_pad, group, threads=threads, avx2=avx2), one)

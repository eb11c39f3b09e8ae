"""The compiled int4 group fits (offload/groupfit.py) against their torch reference (``lsq_torch`` /
``quantize_int4_torch``: tensor ops over [N, K/G, G], an independent implementation of the same steps).

What "equal up to float rounding" means here (the compiled fit sums each group in float64 and rounds to float32
where torch sums in float32, so a mean or covariance may differ in its last place; measured on [2048, 2048]
Student-t(5) weights, G = 32 / 64 / 128: 0-7 codes of 4.2 M differ, 1 group in 65-131 k took a different path):

- codes: identical for at least 99.9 % of the weights (:data:`CODES_EQUAL`);
- the fit (float32 s, m): per group squared error within 1e-5 relative of torch's (:data:`ERR_REL`) for all but
  max(1, 0.01 %) of the groups (:func:`_few`), and the whole matrix's within 1e-6;
- min/max (no fit): codes, scales and zeros bit-equal in every dtype (the same float32 operations).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from expertcache import compiled
from expertcache.offload import groupfit
from expertcache.offload.quant import QuantMatrix, kernel_for, pack_matrix, quantize_codes

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_numba = pytest.mark.skipif(not compiled.AVAILABLE, reason="the compiled fit needs numba")

CODES_EQUAL = 0.999
ERR_REL = 1e-5
SRC = Path(__file__).resolve().parents[1] / "src"


def _student_t(n: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    chi2 = torch.randn(5, n, k, generator=g).pow(2).sum(0)  # Student-t(5) = N / sqrt(chi2(5) / 5)
    return (w / (chi2 / 5).sqrt()).to(dtype).float()


def _fit_err(w_NBG, s, m):
    q = torch.round((w_NBG - m[..., None]) / s[..., None]).clamp(0, 15)
    return (q * s[..., None] + m[..., None] - w_NBG).double().pow(2).sum(-1)


def _dequant_err(w_NBG, q, s, z):
    return ((q - 8) * s[..., None] + z[..., None] - w_NBG).double().pow(2).sum(-1)


def _few(n_groups: int) -> int:
    return max(1, n_groups // 10_000)


def _torch_path(monkeypatch):
    monkeypatch.setattr(compiled, "AVAILABLE", False)


@needs_numba
@pytest.mark.parametrize("n,k,group", [(64, 512, 32), (96, 256, 64), (32, 1024, 128), (48, 99, 33)])
def test_fit_equals_torch_up_to_rounding(n, k, group):
    """s and m of the compiled fit against lsq_torch, float32 (an odd G runs the loop's tail)."""
    w = _student_t(n, k, seed=group).view(n, k // group, group)
    lo, hi = w.amin(2), w.amax(2)
    s0, m0 = groupfit.lsq_torch(w, lo, hi)
    s1, m1 = groupfit.lsq(w, lo, hi)
    assert s1.dtype == torch.float32 and s1.shape == s0.shape
    e0, e1 = _fit_err(w, s0, m0), _fit_err(w, s1, m1)
    off = ((e1 - e0).abs() > ERR_REL * e0).sum().item()
    assert off <= _few(e0.numel()), off
    assert abs(e1.sum() / e0.sum() - 1) < 1e-6
    close = ((s1 - s0).abs() <= 1e-5 * s0).float().mean().item()
    assert close >= 0.999


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_lsq_codes_equal_torch(dtype, group):
    """quantize_int4 (compiled) against quantize_int4_torch with the stored scales and zeros rounded to ``dtype``;
    weights drawn in bf16 for the bf16 case (a checkpoint's values)."""
    n, k = 128, 1024
    w = _student_t(n, k, seed=7 + group, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    w = w.view(n, k // group, group)
    q0, s0, z0 = groupfit.quantize_int4_torch(w, dtype, "lsq")
    q1, s1, z1 = groupfit.quantize_int4(w, dtype, "lsq")
    assert q1.dtype == torch.int32 and q1.shape == w.shape
    assert (q1 == q0).float().mean().item() >= CODES_EQUAL
    assert torch.equal(s1.to(dtype).float(), s1) and torch.equal(z1.to(dtype).float(), z1)  # dtype values
    e0, e1 = _dequant_err(w, q0, s0, z0), _dequant_err(w, q1, s1, z1)
    tol = ERR_REL if dtype == torch.float32 else 2 ** -6  # bf16/fp16: a zero one ulp apart moves a group's error
    assert ((e1 - e0).abs() > tol * e0).sum().item() <= _few(e0.numel())
    assert abs(e1.sum() / e0.sum() - 1) < (1e-6 if dtype == torch.float32 else 1e-4)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_minmax_is_bit_equal(dtype):
    w = _student_t(64, 512, seed=3).view(64, 8, 64)
    w[0, 0] = 0.25  # a constant group
    for a, b in zip(groupfit.quantize_int4_torch(w, dtype, "minmax"), groupfit.quantize_int4(w, dtype, "minmax")):
        assert torch.equal(a, b)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_constant_and_outlier_groups(dtype):
    """Constant groups (zero and not: s = 1, z = the value, every code 8), a group of one outlier among zeros,
    one outlier among Student-t values, a group of two values: the same as torch's."""
    n, g = 16, 32
    w = _student_t(n, 4 * g, seed=11).view(n, 4, g)
    w[0, 0] = 0.0
    w[0, 1] = -0.125
    w[1, 0] = 0.0
    w[1, 0, 5] = 3.0
    w[1, 1, 17] = -2.5
    w[2, 0] = torch.where(torch.arange(g) % 2 == 0, 0.01, -0.01)
    w[2, 1] = 1e-30  # below float32's normal range relative to nothing: still a constant group
    q0, s0, z0 = groupfit.quantize_int4_torch(w, dtype, "lsq")
    q1, s1, z1 = groupfit.quantize_int4(w, dtype, "lsq")
    for r, b in ((0, 0), (0, 1), (2, 1)):
        assert s1[r, b] == 1 and bool((q1[r, b] == 8).all()) and z1[r, b] == w[r, b, 0].to(dtype).float()
    assert torch.equal(q1, q0)
    if dtype == torch.float32:  # unrounded: the fitted s and z may differ in their last places
        assert torch.allclose(s1, s0, rtol=1e-5, atol=0) and torch.allclose(z1, z0, rtol=1e-5, atol=1e-7)
    else:
        assert torch.equal(s1, s0) and torch.equal(z1, z0)
    wr = (q1[1, 0] - 8) * s1[1, 0] + z1[1, 0]
    assert abs(wr[5] - 3.0) < 0.05 and wr[torch.arange(g) != 5].abs().max() < 0.05  # the outlier and the zeros kept


@needs_numba
def test_k_padding_as_pack_matrix_pads(monkeypatch):
    """The shipped models' K = 144 padded to 160 with G = 32 (pack_matrix repeats the last column): the packed
    bytes and scales of the compiled path equal the torch path's (the codes of this matrix are all equal)."""
    w = _student_t(32, 144, seed=5, dtype=torch.bfloat16)
    qm = QuantMatrix("int4", kernel_for("int4", "cpu"), 32, 144, 32, torch.bfloat16, "lsq")
    assert qm.k_pad == 160
    packed1, sz1 = pack_matrix(w, qm)
    q1, s1, z1 = quantize_codes(torch.nn.functional.pad(w[None], (0, 16), mode="replicate")[0], "int4", 32,
                                torch.bfloat16, optimize="lsq")
    _torch_path(monkeypatch)
    packed0, sz0 = pack_matrix(w, qm)
    q0, s0, z0 = quantize_codes(torch.nn.functional.pad(w[None], (0, 16), mode="replicate")[0], "int4", 32,
                                torch.bfloat16, optimize="lsq")
    assert torch.equal(q1, q0) and torch.equal(s1, s0)
    assert (z1 == z0).float().mean().item() >= 0.99  # a zero may sit one bf16 ulp apart
    assert sz1.shape == sz0.shape == (5, 32, 2) and packed1.shape == packed0.shape
    if torch.equal(z1, z0):
        assert torch.equal(packed1, packed0) and torch.equal(sz1, sz0)


@needs_numba
@pytest.mark.parametrize("group", [32, 64, 128])
def test_lsq_never_loses_to_min_max(group):
    """Per group, before the storage rounding (float32): the least-squares fit's squared error is at most
    min/max's (its first candidate starts there and no step raises the error)."""
    w = _student_t(64, 1024, seed=group + 1)
    _, sm, zm = quantize_codes(w, "int4", group, torch.float32, optimize="minmax")
    ql, sl, zl = quantize_codes(w, "int4", group, torch.float32, optimize="lsq")
    wb = w.view(64, -1, group)
    qm = torch.round((wb - zm[..., None]) / sm[..., None] + 8).clamp(0, 15)
    em, el = _dequant_err(wb, qm, sm, zm), _dequant_err(wb, ql.view_as(wb), sl, zl)
    assert bool((el <= em * (1 + 1e-5) + 1e-12).all())
    assert el.sum() < 0.95 * em.sum()


@needs_numba
def test_threads_do_not_change_the_result():
    """Rows are fitted independently: blocks on 3 threads (an uneven split) equal one call on one thread."""
    w = _student_t(200, 256, seed=9).view(200, 8, 32)
    one = groupfit.quantize_int4(w, torch.bfloat16, "lsq", n_threads=1)
    three = groupfit.quantize_int4(w, torch.bfloat16, "lsq", n_threads=3)
    for a, b in zip(one, three):
        assert torch.equal(a, b)
    lo, hi = w.amin(2), w.amax(2)
    for a, b in zip(groupfit.lsq(w, lo, hi, n_threads=1), groupfit.lsq(w, lo, hi, n_threads=3)):
        assert torch.equal(a, b)
    assert 1 <= groupfit.threads() <= groupfit.MAX_THREADS


def test_rounders_equal_torch():
    """numpy's rounding of the stored scales and zeros to bf16 / fp16 equals torch's ``.to(dtype).float()``
    (nearest even, ties, overflow to inf, subnormals, NaN)."""
    odd = [1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.4e38, -3.4e38, 1e-40, 65520.0, 6e-8, float("inf"), float("nan"), 0.0, -0.0]
    x = torch.cat([_student_t(1, 4096, seed=1)[0], torch.tensor(odd)])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = torch.from_numpy(groupfit._rounder(dtype)(x.numpy().copy()))
        want = x.to(dtype).float()
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()], want[~want.isnan()]), dtype
    assert groupfit._rounder(torch.float64) is None


def test_without_numba_the_torch_path_runs(monkeypatch):
    """With the compiled loops off (compiled.AVAILABLE false, as EXPERTCACHE_NO_NUMBA=1 makes it), quantize_codes
    is the torch reference, bit for bit."""
    w = _student_t(32, 256, seed=2)
    want = groupfit.quantize_int4_torch(w.view(32, 8, 32), torch.bfloat16, "lsq")
    _torch_path(monkeypatch)
    q, s, z = quantize_codes(w, "int4", 32, torch.bfloat16, optimize="lsq")
    assert torch.equal(q, want[0].view(32, 256)) and torch.equal(s.float(), want[1]) and torch.equal(z.float(), want[2])
    lo, hi = w.view(32, 8, 32).amin(2), w.view(32, 8, 32).amax(2)
    for a, b in zip(groupfit.lsq(w.view(32, 8, 32), lo, hi), groupfit.lsq_torch(w.view(32, 8, 32), lo, hi)):
        assert torch.equal(a, b)


_CHILD = """
import hashlib, torch
from expertcache import compiled
from expertcache.offload.quant import quantize_codes
g = torch.Generator().manual_seed(4)
w = torch.randn(64, 256, generator=g) * 0.02
q, s, z = quantize_codes(w, "int4", 64, torch.bfloat16, optimize="lsq")
print(compiled.AVAILABLE, hashlib.sha256(q.numpy().tobytes() + s.float().numpy().tobytes()
                                         + z.float().numpy().tobytes()).hexdigest())
"""


def test_no_numba_variable_gives_the_torch_path():
    """``EXPERTCACHE_NO_NUMBA=1`` in a fresh process: no compiled loops, and the torch reference's result."""
    env = dict(os.environ, EXPERTCACHE_NO_NUMBA="1", PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    flag, digest = out.stdout.split()
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 256, generator=g) * 0.02
    q, s, z = groupfit.quantize_int4_torch(w.view(64, 4, 64), torch.bfloat16, "lsq")
    import hashlib

    want = hashlib.sha256(q.view(64, 256).numpy().tobytes() + s.numpy().tobytes() + z.numpy().tobytes()).hexdigest()
    assert flag == "False" and digest == want


@needs_numba
@pytest.mark.slow
@pytest.mark.parametrize("group", [32, 64, 128])
def test_an_olmoe_expert_matrix(group):
    """One OLMoE-1B-7B gate_up matrix [2048, 2048] in bf16: codes, scales and zeros against torch's."""
    w = _student_t(2048, 2048, seed=group, dtype=torch.bfloat16).view(2048, -1, group)
    q0, s0, z0 = groupfit.quantize_int4_torch(w, torch.bfloat16, "lsq")
    q1, s1, z1 = groupfit.quantize_int4(w, torch.bfloat16, "lsq")
    assert (q1 == q0).float().mean().item() >= 0.9999
    assert (z1 == z0).float().mean().item() >= 0.999 and (s1 == s0).float().mean().item() >= 0.999
    e0, e1 = _dequant_err(w, q0, s0, z0), _dequant_err(w, q1, s1, z1)
    assert abs(e1.sum() / e0.sum() - 1) < 1e-5


@needs_numba
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_fits_on_its_own_threads():
    """The helper threads are the parent's: a child forked after a threaded fit starts its own (no hang)."""
    w = _student_t(64, 4096, seed=12).view(64, 128, 32)
    want = groupfit.quantize_int4(w, torch.bfloat16, "lsq", n_threads=2)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            got = groupfit.quantize_int4(w, torch.bfloat16, "lsq", n_threads=2)
            os.write(wfd, b"1" if all(torch.equal(a, b) for a, b in zip(got, want)) else b"0")
        finally:
            os._exit(0)
    os.close(wfd)
    try:
        import select

        ready, _, _ = select.select([r], [], [], 20)
        if not ready:
            os.kill(pid, 9)
        assert ready, "the forked child's fit hung"
        assert os.read(r, 1) == b"1"
    finally:
        os.waitpid(pid, 0)
        os.close(r)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_is_bit_equal(dtype):
    """The int8 step (per-row max|w| / 127, rounded codes) compiled equals torch's, a zero row (s = 1) and ties
    (w an exact half multiple of s) included; and on 3 threads as on one."""
    w = _student_t(300, 208, seed=13)
    w[0] = 0
    w[1, :3] = torch.tensor([1.27, 0.005, -0.015])  # s = 0.01 in float32: exact .5 ties round to even
    want = groupfit.quantize_int8_torch(w, dtype)
    for n_threads in (None, 1, 3):
        got = groupfit.quantize_int8(w, dtype, n_threads=n_threads)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q, s, z = quantize_codes(w, "int8", 0, dtype)
    assert z is None and s.dtype == dtype and torch.equal(q, want[0])


def test_scale_zero_helpers_equal_torch():
    """``as_dtype`` (numpy) equals ``.to(dtype)`` and ``scales_zeros`` equals torch.stack of the transposes."""
    x = torch.cat([_student_t(1, 4096, seed=14)[0], torch.tensor([1 + 2 ** -8, 3.4e38, 65520.0, float("inf"), 0.0])])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(groupfit.as_dtype(x, dtype), x.to(dtype))
        s, z = x[:4096].view(64, 64).to(dtype), x[:4096].flip(0).view(64, 64).to(dtype)
        got = groupfit.scales_zeros(s.T, z.T)
        assert got.is_contiguous() and torch.equal(got, torch.stack([s.T, z.T], dim=-1))

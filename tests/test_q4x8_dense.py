"""The int4 dense part (``--quant-dense int4`` / ``int4-head8``) on the q4x8 kernel (offload/q4x8.py) where the
int4 experts would be (``quant.dense_int4_kernel``): the layout, the product, the dense cache's key, the choice.

References are computed here, independently of the kernel: the codes and (s, z) read back from the module's buffers
(``q4x8.unpack_codes``; the layout's [N, K/G, 2] scales), dequantised in float64 by plain torch; x quantised per row
by hand (``a = max|x| / 127``, ``round(x / a)``). The product must equal ``x @ Wdeq.T + b`` within the activation's
rounding, at most ``a/2`` per element of x through ``|(q - 8)·s|`` (tests/test_q4x8.py's bound).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload import q4x8
from expertcache.offload.kernelnote import kernel_choice_line
from expertcache.offload.quant import DENSE_INT4_KERNEL_VAR, EXPERT_KERNEL_VAR, dense_int4_kernel, int4pack_codes

needs_numba = pytest.mark.skipif(not q4x8.available(), reason="q4x8 needs numba")


def _linear(n, k, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(0.5)
    return lin


def _quant(lin, kernel, monkeypatch, mode="int4"):
    from expertcache.offload.qlinear import QuantLinear

    monkeypatch.setenv(DENSE_INT4_KERNEL_VAR, kernel)
    return QuantLinear.from_linear(lin, mode)


def _by_hand(x_MK, q, sz, bias, group):
    """(x @ Wdeq.T + b in float64, the activation-rounding bound per output) for codes q [N, K_pad], sz [N, K/G, 2]."""
    n, k = q.shape
    x = F.pad(x_MK.double(), (0, k - x_MK.shape[1]))
    s, z = sz[..., 0].double(), sz[..., 1].double()
    wq = ((q.double() - 8).view(n, -1, group) * s[..., None]).view(n, k)
    w = wq + z[..., None].expand(n, k // group, group).reshape(n, k)
    a = x.abs().amax(1, keepdim=True) / 127
    exact = x @ w.T
    if bias is not None:
        exact[:, :bias.shape[0]] += bias.double()
    return exact, (a / 2) @ wq.abs().sum(1, keepdim=True).T


@needs_numba
@pytest.mark.parametrize("n, k, rows, bias", [(100, 144, 1, True), (64, 64, 3, False), (48, 104, 16, True),
                                               (128, 256, 40, True)])
def test_the_q4x8_quantlinear_is_the_int8_activation_times_the_dequantised_weight(n, k, rows, bias, monkeypatch):
    """K padded to DENSE_GROUP (144 -> 160, 104 -> 128), N to 16 (100 -> 112, 48 -> 48); x with leading dims
    [2, rows, K]; float32 and bf16; the same codes as the int4pack module, and its output within the bound."""
    from expertcache.offload.qlinear import DENSE_GROUP

    lin = _linear(n, k, bias)
    mine, theirs = _quant(lin, "q4x8", monkeypatch), _quant(lin, "int4pack", monkeypatch)
    assert mine.kernel == "q4x8" and mine.qm.kernel == q4x8.KERNEL and theirs.kernel == "int4pack"
    assert mine.qm.n_pad % 16 == 0 and mine.qm.k_pad % DENSE_GROUP == 0 and mine.qm.k_pad >= k
    assert mine.qm.part_bytes() == theirs.qm.part_bytes()  # the same byte count: the memory plan is unchanged
    q = q4x8.unpack_codes(mine.qweight)
    assert torch.equal(q, int4pack_codes(theirs.qweight, theirs.qm))  # the same codes, in another order
    assert torch.equal(mine.scales, theirs.scales.transpose(0, 1))
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, 0] = 0  # a row of zeros: exactly the bias
    exact, bound = _by_hand(x.reshape(-1, k), q, mine.scales, mine.bias, DENSE_GROUP)
    exact, bound = exact[:, :n].view(2, rows, n), bound[:, :n].view(2, rows, n)
    with torch.inference_mode():
        got, ref = mine(x), theirs(x)
        assert got.shape == (2, rows, n) and got.dtype == torch.float32
        assert ((got.double() - exact).abs() <= bound * 1.001 + 1e-5).all()
        assert ((got.double() - ref.double()).abs() <= bound * 1.001 + 2e-5).all()
        assert torch.equal(got[0, 0], torch.zeros(n) if lin.bias is None else lin.bias.detach())
        lb = _linear(n, k, bias).bfloat16()
        mb, tb = _quant(lb, "q4x8", monkeypatch), _quant(lb, "int4pack", monkeypatch)
        xb = x.bfloat16()
        gb, rb = mb(xb), tb(xb)
        assert gb.dtype == torch.bfloat16 and gb.shape == (2, rows, n)
        assert ((gb - rb).float().norm() / rb.float().norm()).item() < 0.02


def test_the_choice_follows_the_experts_and_is_forced_by_its_own_variable(monkeypatch):
    monkeypatch.delenv(DENSE_INT4_KERNEL_VAR, raising=False)
    monkeypatch.setenv(EXPERT_KERNEL_VAR, "int4pack")  # forces the experts only
    monkeypatch.setattr(q4x8, "available", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert dense_int4_kernel() == "q4x8"
    assert dense_int4_kernel(compiled=True) == "int4pack"  # --compile traces the product
    assert dense_int4_kernel("cuda") == "int4pack"
    line = kernel_choice_line(None, "int4")
    assert "dense part int4 q4x8 (numba" in line
    assert "attention q4x8 (numba" in kernel_choice_line(None, "int4-head8")
    assert "dense part int4 _weight_int4pack_mm_for_cpu" in kernel_choice_line(None, "int4", compiled=True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert dense_int4_kernel() == "int4pack"
    assert "dense part int4 _weight_int4pack_mm_for_cpu" in kernel_choice_line(None, "int4")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # AVX-512, one thread: q4x8, as the experts
    assert dense_int4_kernel() == "q4x8"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv(DENSE_INT4_KERNEL_VAR, "q4x8")
    assert dense_int4_kernel() == "q4x8" and dense_int4_kernel(compiled=True) == "int4pack"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv(DENSE_INT4_KERNEL_VAR, "int4pack")
    assert dense_int4_kernel() == "int4pack"
    monkeypatch.delenv(DENSE_INT4_KERNEL_VAR)
    monkeypatch.setattr(q4x8, "available", lambda: False)  # no numba: torch's kernel
    assert dense_int4_kernel() == "int4pack"
    monkeypatch.setenv(DENSE_INT4_KERNEL_VAR, "q4x8")
    with pytest.raises(ValueError, match="EXPERTCACHE_DENSE_INT4_KERNEL=q4x8 needs numba"):
        dense_int4_kernel()
    monkeypatch.setenv(DENSE_INT4_KERNEL_VAR, "bogus")
    with pytest.raises(ValueError, match="EXPERTCACHE_DENSE_INT4_KERNEL must be one of int4pack, q4x8, got 'bogus'"):
        dense_int4_kernel("cuda")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_dense_cache import _olmoe

    return _olmoe(tmp_path_factory.mktemp("q4x8-dense") / "m")


def _start(path, kernel, monkeypatch, quant_dense="int4", **kw):
    from conftest import decode_logits

    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.qlinear import dense_bytes, dense_kernel_note

    monkeypatch.setenv(DENSE_INT4_KERNEL_VAR, kernel)
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant_dense=quant_dense, **kw),
                                        dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])
    logits = decode_logits(rt, ids, prefill=4).float()
    d = rt.describe()
    out = dict(logits=logits, load=d["dense_load"], note=dense_kernel_note(rt.model),
               plan=rt.plan.non_expert_bytes, bytes=dense_bytes(rt.model, None))
    rt.close()
    return out


@needs_numba
def test_the_dense_cache_keys_the_layout_and_a_second_start_reads_it(tiny, tmp_path, monkeypatch):
    """q4x8 and int4pack pack to two files; each second start reads its own (no packing) and computes the same
    logits; the plan's non-expert bytes are the same for both layouts; the decode logits are close."""
    from expertcache.offload.qlinear import QuantLinear

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    warmed = []
    monkeypatch.setattr(q4x8, "warm", lambda: warmed.append(True))  # compiled before the plan (preflight)
    first = {k: _start(tiny, k, monkeypatch) for k in ("int4pack", "q4x8")}
    assert warmed == [True]  # only for q4x8
    assert "int4 q4x8 ×" in first["q4x8"]["note"] and "q4x8" not in first["int4pack"]["note"]
    assert first["q4x8"]["load"]["dense_cache"] == first["int4pack"]["load"]["dense_cache"] == "written"
    assert first["q4x8"]["load"]["path"] != first["int4pack"]["load"]["path"]
    assert first["q4x8"]["plan"] == first["int4pack"]["plan"] and first["q4x8"]["bytes"] == first["int4pack"]["bytes"]
    calls = []
    real = QuantLinear.load_rows
    monkeypatch.setattr(QuantLinear, "load_rows", lambda self, *a, **k: (calls.append(1), real(self, *a, **k)))
    for k in ("q4x8", "int4pack"):
        second = _start(tiny, k, monkeypatch)
        assert second["load"] == dict(second["load"], dense_cache="read", path=first[k]["load"]["path"])
        assert torch.equal(second["logits"], first[k]["logits"]) and not calls
    a, b = first["q4x8"]["logits"], first["int4pack"]["logits"]
    assert ((a - b).norm() / b.norm()).item() < 0.02
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


@needs_numba
def test_a_file_of_the_other_layout_is_never_read(tiny, tmp_path, monkeypatch, capsys):
    """The int4pack file copied to the q4x8 file's name: refused by its recipe (packed again, a note), never used."""
    import shutil
    from pathlib import Path

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    ref = _start(tiny, "q4x8", monkeypatch)
    other = _start(tiny, "int4pack", monkeypatch)
    shutil.copyfile(other["load"]["path"], ref["load"]["path"])
    capsys.readouterr()
    again = _start(tiny, "q4x8", monkeypatch)
    assert again["load"]["dense_cache"] == "written" and Path(again["load"]["path"]).is_file()
    assert "packed dense weights for another recipe" in capsys.readouterr().err
    assert torch.equal(again["logits"], ref["logits"])


@needs_numba
def test_the_q4m_preset_decodes_on_q4x8_close_to_int4pack(tiny, tmp_path, monkeypatch):
    """``--quant q4m`` (int4 experts, attention int4, lm_head int8, embedding int4 rows) with the dense int4 on q4x8
    against int4pack (the experts' kernel forced alike): logits close."""
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(EXPERT_KERNEL_VAR, "int4pack")
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "int8pack")  # its lm_head weight-only (q8x8: test_q8x8.py)
    got = {k: _start(tiny, k, monkeypatch, quant_dense=None, quant="q4m", io="cached", readers=0)
           for k in ("int4pack", "q4x8")}
    assert "int4 q4x8 ×" in got["q4x8"]["note"] and "int8 int8pack ×1" in got["q4x8"]["note"]
    a, b = got["q4x8"]["logits"], got["int4pack"]["logits"]
    assert ((a - b).norm() / b.norm()).item() < 0.02
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


def test_a_bad_dense_kernel_variable_is_one_error_line(tiny, monkeypatch, capsys):
    from expertcache.cli.main import main

    monkeypatch.setenv(DENSE_INT4_KERNEL_VAR, "bogus")
    code = main(["generate", "--model", str(tiny), "--quant-dense", "int4", "--max-new-tokens", "2", "5 6 7"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and DENSE_INT4_KERNEL_VAR in lines[0] and "q4x8" in lines[0], err

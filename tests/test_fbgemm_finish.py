"""FBGEMM's packed weight of an int8 ``QuantLinear`` made from the codes, a block of rows at a time
(``offload/fbgemm.py``): the same product as packing the whole matrix from its float32 product (the earlier
path), and a transient the memory plan's loading term counts (``preflight.finish_transient_bytes``) -- the earlier
path held 8 bytes per element (786 MiB for a 50304 × 2048 ``lm_head``), which no term counted."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from expertcache.offload.fbgemm import FBGEMM_ROWS, fbgemm_linear, fbgemm_prepack
from expertcache.offload.preflight import finish_transient_bytes
from expertcache.offload.qlinear import QuantLinear, fbgemm_shapes
from expertcache.offload.quant import dense_int8_kernel, fbgemm_vnni

pytestmark = pytest.mark.skipif(dense_int8_kernel("cpu") != "fbgemm", reason="torch without FBGEMM")
MiB = 2**20


@pytest.fixture(autouse=True)
def _fbgemm_dense(monkeypatch):
    """FBGEMM's int8 dense path, whatever this CPU's default (q8x8 on AVX2 without VNNI: tests/test_q8x8.py)."""
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "fbgemm")


def _whole_from_float(codes: torch.Tensor, scales: torch.Tensor):
    """The earlier path: the whole matrix quantised back from codes · s in float32, one ``linear_prepack``."""
    s = scales.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(codes.float() * s.float()[:, None], s, torch.zeros_like(s, dtype=torch.long),
                                        0, torch.qint8)
        assert torch.equal(qw.int_repr(), codes)
        return torch.ops.quantized.linear_prepack(qw, None)


@pytest.mark.parametrize("n,k,rows", [(300, 64, 128), (8192, 1000, FBGEMM_ROWS), (1000, 48, 64), (64, 32, 4096)])
def test_blocked_prepack_from_codes_equals_the_whole_float_path(n, k, rows):
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) / 100 + 1e-4
    x = torch.randn(5, k, generator=g)
    packed = fbgemm_prepack(codes, scales, rows=rows)
    assert len(packed) == -(-n // rows)
    for rr in (False, True):
        want = torch.ops.quantized.linear_dynamic(x, _whole_from_float(codes, scales), rr)
        assert torch.equal(fbgemm_linear(x, packed, rr), want)
        if not rr and not fbgemm_vnni():  # 8-bit activations on AVX2's vpmaddubsw saturate int16 (why rr exists)
            continue
        # against the dequantised matrix, independently: within the activation's 8-bit (7-bit) rounding
        exact = x.double() @ (codes.double() * scales.double()[:, None]).T
        step = (x.max() - x.min()).double() / (127 if rr else 255)  # one scale per call over the whole input
        bound = step / 2 * (codes.double().abs() * scales.double()[:, None]).sum(1) + 1e-4
        assert ((fbgemm_linear(x, packed, rr).double() - exact).abs() <= bound).all()


def test_quantlinear_with_padded_k_matches_a_dequantised_matmul():
    """K = 1000 is padded to 1008 in the codes buffer: finish drops the padding (a strided slice of the codes)."""
    torch.manual_seed(0)
    lin = nn.Linear(1000, 5000, bias=True)
    q = QuantLinear.from_linear(lin, "int8")
    assert q.kernel == "fbgemm" and len(q._fbgemm) == -(-5000 // FBGEMM_ROWS) and q.qweight.numel() == 0
    x = torch.randn(3, 1000)
    ref = lin(x)
    err = (q(x) - ref).abs().max() / ref.abs().max()
    assert err < 0.02, err


def test_bad_codes_are_refused():
    with pytest.raises(ValueError, match="int8 codes"):
        fbgemm_prepack(torch.zeros(4, 4), torch.ones(4))
    with pytest.raises(ValueError, match="rows"):
        fbgemm_prepack(torch.zeros(4, 4, dtype=torch.int8), torch.ones(4), rows=0)


class _Skeleton(nn.Module):
    def __init__(self, n, k):
        super().__init__()
        self.embed = nn.Embedding(16, k, device="meta")
        self.lm_head = nn.Linear(k, n, bias=False, device="meta")

    def get_input_embeddings(self):
        return self.embed


def test_fbgemm_shapes_name_the_matrices_finish_hands_to_fbgemm(monkeypatch):
    m = _Skeleton(5000, 1000)
    assert fbgemm_shapes(m, "int8", "cpu") == [(5000, 1000, 5000 * 1008)]  # K padded to 16
    assert fbgemm_shapes(m, "int4", "cpu") == []  # int4 lm_head: the int4 kernel
    assert fbgemm_shapes(m, "int4-head8", "cpu") == [(5000, 1000, 5000 * 1008)]  # the variable forces it too
    monkeypatch.delenv("EXPERTCACHE_DENSE_INT8_KERNEL")
    assert fbgemm_shapes(m, "int4-head8", "cpu") == []  # unforced: weight-only (or q8x8) lm_head
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "fbgemm")
    assert fbgemm_shapes(m, "int8", "cpu", compiled=True) == []  # --compile: int8pack
    assert fbgemm_shapes(m, None, "cpu") == [] and finish_transient_bytes(m, None, "cpu") == 0
    assert finish_transient_bytes(m, "int8", "cpu") == 5000 * 1008 + 4 * FBGEMM_ROWS * 1000


_PEAK = r"""
import json, sys, torch
from expertcache.offload.budget import release_free_heap
from expertcache.offload.qlinear import QuantLinear
torch.set_num_threads(1)
n, k = int(sys.argv[1]), int(sys.argv[2])
def status(key):
    return next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith(key))
q = QuantLinear(n, k, "int8", torch.bfloat16)
g = torch.Generator().manual_seed(0)
q.load_rows(lambda a, b: torch.randn(b - a, k, generator=g))
release_free_heap()
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
q.finish()
print(json.dumps(dict(growth=status("VmHWM:") - before, kept=status("VmRSS:") - before, blocks=len(q._fbgemm))))
"""


@pytest.mark.parametrize("n,k", [(8192, 1000), (50304, 2048)])
def test_finish_peak_rss_stays_within_the_plans_loading_term(n, k):
    """The peak RSS growth of ``QuantLinear.finish`` (VmHWM reset just before it, in a fresh process) is within
    ``finish_transient_bytes`` of a skeleton with this ``lm_head``. Before the blocked prepack from codes: 8.0
    bytes per element (62 MiB and 786 MiB here) against a term of 1 byte per element + 4 blocks; measured now
    1.0 element + 1.1-2.3 blocks (16.9 and 106.7 MiB)."""
    if not os.access("/proc/self/clear_refs", os.W_OK) or not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc/self/clear_refs and /proc/self/status")
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(n), str(k)], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    term = finish_transient_bytes(_Skeleton(n, k), "int8", "cpu")
    assert r["growth"] <= term, (r["growth"] / MiB, term / MiB)
    assert r["blocks"] == -(-n // FBGEMM_ROWS)
    assert r["kept"] <= 4 * MiB, r["kept"] / MiB  # FBGEMM's copy replaces the codes; the freed blocks given back


def test_loading_counts_the_finish_and_trims_the_heap_after_it(tmp_path, monkeypatch):
    """An int8 dense part whose ``lm_head`` hand-over is the largest loading transient: the plan's ``load_bytes``
    is ``finish_transient_bytes`` (N·K_pad + 4 blocks, computed here from the shape), and ``load_non_expert``
    trims the heap once every module is handed to FBGEMM (before the runtime allocates the expert slots)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from expertcache.offload import OffloadConfig, OffloadedModel, loader

    cfg = AutoConfig.for_model("olmoe", vocab_size=5000, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    seen = []

    def trim():
        seen.append(None)
        return True

    real_finish = QuantLinear.finish

    def finish(self):
        real_finish(self)
        seen.append(self.out_features)

    monkeypatch.setattr(loader, "release_free_heap", trim)
    monkeypatch.setattr(QuantLinear, "finish", finish)
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    rt = OffloadedModel.from_pretrained(tmp_path / "m", OffloadConfig(tier="host", quant_dense="int8", memory="auto"),
                                        dtype=torch.float32)
    try:
        assert rt.plan.load_bytes >= 5000 * 64 + 4 * FBGEMM_ROWS * 64  # the finish counted (another loading term may be larger)
        assert seen.count(None) == 1 and seen[-1] is None and 5000 in seen  # trimmed after the last hand-over
        assert len(seen) == 1 + 5  # q, k, v, o and lm_head handed over first
    finally:
        rt.close()

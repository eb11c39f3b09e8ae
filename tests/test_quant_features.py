"""Quantised layers on every family's features, against an independent float computation written here from the
contract of offload/quant.py (int8: ``W ≈ q·s``, ``s = max|row| / 127`` per output row; int4: groups of G along K,
``s = (max - min) / 15``, ``z = min + 8·s``, ``q = clamp(round((w - z) / s) + 8, 0, 15)``, ``W ≈ (q - 8)·s + z``):

- ``--quant-dense`` on every registered family's tiny model: every replaced projection (Qwen2-MoE's q/k/v with
  their biases) equals ``x @ Ŵ.T + b`` for one token and for several (a prefill), and keeps its bias;
- shapes the kernels must pad (K not a multiple of 16 / G, N not a multiple of 16, a partial last group),
  one and many rows;
- a prefill (several tokens in one step) through the precision rule with every miss at low precision: the
  runtime's logits equal the stock model whose experts are the independently dequantised int4 matrices;
- the precision rule's multi-token budget (per token, times the step's tokens) at its boundary.

Surviving mutants of this file's own set: none.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from expertcache.models import SUPPORTED_MODEL_TYPES, load_model
from expertcache.models.tiny import save_tiny
from expertcache.offload.qlinear import DENSE_GROUP, QuantLinear, dense_targets, quantize_dense
from expertcache.routing.precision import PrecisionRule, serve_low

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _weight_only_int8_dense(monkeypatch):
    """These tests pin the weight-only contract (``x @ dequant(W).T``) on every family: ``--quant-dense int8`` on
    ``_weight_int8pack_mm`` here; FBGEMM's int8-activation path (chosen on x86) has its own tests
    (test_quant_kernels.py, test_dense_cache.py); so has q4x8's int8-activation int4 product (the AVX2 default, and
    AVX-512's with one torch thread, as here: test_q4x8.py, test_q4x8_dense.py): torch's int4 kernel is pinned."""
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "int8pack")
    monkeypatch.setenv("EXPERTCACHE_EXPERT_KERNEL", "int4pack")
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT4_KERNEL", "int4pack")


def dequant(w_NK: torch.Tensor, mode: str, group: int) -> torch.Tensor:
    """The contract's dequantised matrix, any K (a last group shorter than G is its own group); codes from float32
    weights (the compute dtype of these models), as the contract's rounding sees them."""
    w = w_NK.float()
    if mode == "int8":
        s = w.abs().amax(dim=1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        return (torch.round(w / s).clamp(-127, 127) * s).double()
    out = torch.empty_like(w)
    for a in range(0, w.shape[1], group):
        g = w[:, a:a + group]
        lo, hi = g.amin(dim=1, keepdim=True), g.amax(dim=1, keepdim=True)
        s = (hi - lo) / 15
        flat = s == 0
        s = torch.where(flat, torch.ones_like(s), s)
        z = torch.where(flat, lo, lo + 8 * s)
        q = (torch.round((g - z) / s) + 8).clamp(0, 15)
        out[:, a:a + group] = (q - 8) * s + z
    return out.double()


def _ref(lin_w: torch.Tensor, bias, x: torch.Tensor, mode: str, group: int = DENSE_GROUP) -> torch.Tensor:
    y = x.double() @ dequant(lin_w, mode, group).T
    return (y + bias.double()) if bias is not None else y


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("n,k", [(16, 32), (8, 40), (24, 104), (3, 16), (40, 72), (17, 33)])
@pytest.mark.parametrize("m", [1, 5, 17])
def test_padded_shapes_one_and_many_rows(mode, n, k, m):
    g = torch.Generator().manual_seed(n * 1000 + k)
    lin = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        lin.bias.copy_(10 * torch.randn(n, generator=g))  # large: a dropped bias is far outside the tolerance
    q = QuantLinear.from_linear(lin, mode)
    x = torch.randn(m, k, generator=g)
    torch.testing.assert_close(q(x).double(), _ref(lin.weight, lin.bias, x, mode), rtol=1e-4, atol=1e-4)
    # leading shapes: [B, S, K]
    x3 = torch.randn(2, m, k, generator=g)
    assert q(x3).shape == (2, m, n)
    torch.testing.assert_close(q(x3).double(), _ref(lin.weight, lin.bias, x3, mode), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("n,k", [(16, 32), (8, 40), (24, 104), (3, 16), (40, 72), (17, 33), (1, 1)])
def test_the_padding_rule_of_the_kernels(mode, n, k):
    """The contract's padding, whatever this CPU's kernels tolerate (a K the int8 kernel cannot take gives
    silently wrong results on some ISAs only): int8 K to a multiple of 16; int4 K to a multiple of G and of
    32 (tinygemm), N to a multiple of 16; never more than one step of padding."""
    q = QuantLinear(n, k, mode, torch.float32)
    qm = q.qm
    align = 16 if mode == "int8" else max(DENSE_GROUP, 32)
    assert qm.k_pad % align == 0 and k <= qm.k_pad < k + align
    if mode == "int4":
        assert qm.n_pad % 16 == 0 and n <= qm.n_pad < n + 16
    else:
        assert qm.n_pad == n


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("qfam")
    return {arch: save_tiny(arch, root / arch, seed=7) for arch in SUPPORTED_MODEL_TYPES}


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_quant_dense_on_every_family_equals_the_dequantised_float_product(families, arch, mode):
    model = load_model(families[arch])
    before = {name: (m.weight.detach().clone(), None if getattr(m, "bias", None) is None else m.bias.detach().clone())
              for name, m in dense_targets(model).items() if isinstance(m, nn.Linear)}
    assert before, arch
    if arch == "qwen2_moe":  # its attention projections carry biases (q, k, v)
        assert all(before[n][1] is not None for n in before if n.endswith(("q_proj", "k_proj", "v_proj")))
    n = quantize_dense(model, mode)
    assert n >= len(before)
    g = torch.Generator().manual_seed(1)
    for name, (w, b) in before.items():
        q = model.get_submodule(name)
        assert isinstance(q, QuantLinear), name
        assert (q.bias is None) == (b is None), name
        if b is not None:
            assert torch.equal(q.bias, b), name
        for m in (1, 6):  # one token, a prefill
            x = torch.randn(m, w.shape[1], generator=g)
            torch.testing.assert_close(q(x).double(), _ref(w, b, x, mode), rtol=1e-4, atol=1e-4,
                                       msg=lambda s: f"{arch} {name} M={m}: {s}")


# -- a prefill through the precision rule ---------------------------------------------------------


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return save_tiny("olmoe", tmp_path_factory.mktemp("qpre") / "olmoe", seed=5)


def test_a_prefill_with_every_miss_at_low_precision_equals_the_dequantised_model(olmoe, tmp_path, monkeypatch):
    """threshold 2 (above every weight) and no promotion: every expert of every token of the prompt is computed
    from its int4 copy (the cache never fills); a prompt of several tokens in one step and the teacher-forced
    tokens after it equal the stock model whose experts are the contract's dequantised int4 matrices."""
    from conftest import decode_logits

    from expertcache.offload import OffloadConfig, OffloadedModel

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    rt = OffloadedModel.from_pretrained(olmoe, OffloadConfig(io="cached", readers=0, capacity=2,
                                                             resident_quant="int4", low_threshold=2.0),
                                        dtype=torch.float32)
    group = rt.low.layout.group
    ref = load_model(olmoe)
    with torch.no_grad():
        for m in rt.layers:
            ex = ref.model.layers[m.layer_id].mlp.experts
            for e in range(rt.num_experts):
                gu, dn = ex.gate_up_proj[e], ex.down_proj[e]  # [2F, D], [D, F]
                ex.gate_up_proj[e].copy_(dequant(gu, "int4", group).float())
                ex.down_proj[e].copy_(dequant(dn, "int4", group).float())
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids).logits
    got = decode_logits(rt, ids, prefill=6)
    s = rt.stats()
    rt.close()
    assert s["low_computes"] > 0 and s["expert_loads"] == 0
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


# -- the rule's multi-token budget ---------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_the_load_budget_is_per_token_times_the_steps_tokens(tokens):
    """Budget of b loads per token: a step of T tokens loads the b·T heaviest misses, the rest at low precision;
    one byte less than b·T loads' bytes loads one fewer."""
    E, B = 1000, 2
    order = list(range(12))
    weight = [1.0 - i / 20 for i in order]
    resident = [i % 4 == 0 for i in order]  # hits are free: they spend no budget
    misses = [i for i in order if not resident[i]]
    for budget, loads in ((B * E, B * tokens), (B * E - 1, None)):
        low = serve_low(order, weight, resident, PrecisionRule(budget=budget), expert_bytes=E, tokens=tokens)
        want_loads = loads if loads is not None else (budget * tokens) // E
        loaded = [i for i in misses if not low[i]]
        assert loaded == misses[:min(want_loads, len(misses))], (budget, tokens)
        assert not any(low[i] for i in order if resident[i])


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_threshold_is_strict_for_every_step_size(tokens):
    """``w_e < threshold`` (HOBBIT's criterion): a miss whose weight equals the threshold is loaded, one just
    below it is computed at low precision, whatever the step's token count."""
    t = 0.25
    weight = [0.5, t, math.nextafter(t, 0.0), 0.0]
    low = serve_low(list(range(4)), weight, [False] * 4, PrecisionRule(threshold=t), expert_bytes=10, tokens=tokens)
    assert low == [False, False, True, True]

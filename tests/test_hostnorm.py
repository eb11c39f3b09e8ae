"""The host norm (offload/hostnorm.py): one token's RMSNorm in one compiled call, held to its contract by an
independent torch computation (float64 sum of squares, then float32 steps and the rounding to x's dtype), to
transformers' own RMSNorms within one unit, installed only where it agrees with the module and only on runs whose
dense part is quantised on the CPU; a bad $EXPERTCACHE_HOST_NORM refused."""

import pytest
import torch

from expertcache import compiled
from expertcache.offload import hostnorm

needs_numba = pytest.mark.skipif(not compiled.AVAILABLE, reason="the host norm needs numba")


def _by_hand(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The contract again, element by element in Python floats (not the module's reference): float64 sum of
    squares, float32 mean + eps, 1/sqrt, x·r rounded to x's dtype, w·that rounded to x's dtype."""
    import numpy as np

    f = x.detach().float().reshape(-1).numpy()
    s = sum(float(v) * float(v) for v in f)
    v = np.float32(np.float32(np.float32(s) / np.float32(f.size)) + np.float32(eps))
    r = np.float32(np.float32(1.0) / np.float32(np.sqrt(v)))
    h = torch.from_numpy((f * r).astype(np.float32)).to(x.dtype).float()
    return (w.detach().float() * h).to(x.dtype).reshape(x.shape)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [2048, 145, 16, 1])
def test_the_kernel_keeps_its_contract(dtype, d):
    g = torch.Generator().manual_seed(d)
    w = (torch.randn(d, generator=g) * 0.5 + 1).to(dtype)
    for scale in (1e-3, 1.0, 30.0):
        x = (torch.randn(1, 1, d, generator=g) * scale).to(dtype)
        got = hostnorm.rms_norm(x, w, 1e-6)
        assert got.shape == x.shape and got.dtype == dtype
        want = _by_hand(x, w, 1e-6)
        # the float64 sum's order may differ from Python's in its last bits: within one unit, nearly all equal
        unit = torch.finfo(dtype).eps * want.float().abs()
        assert ((got.float() - want.float()).abs() <= unit).all()
        assert (got == want).float().mean() >= 0.99
        assert torch.equal(hostnorm.reference(x, w, 1e-6), got) or \
            ((hostnorm.reference(x, w, 1e-6).float() - got.float()).abs() <= unit).all()


@needs_numba
def test_the_kernel_refuses_what_it_does_not_compute():
    w = torch.ones(8, dtype=torch.bfloat16)
    for x, ww in ((torch.ones(2, 8, dtype=torch.bfloat16), w), (torch.ones(8, dtype=torch.float16), w.half()),
                  (torch.ones(8), w), (torch.ones(4, dtype=torch.bfloat16), w)):
        with pytest.raises(ValueError, match="one row of bf16 or float32"):
            hostnorm.rms_norm(x, ww, 1e-6)


def _norm_classes():
    """transformers' RMSNorms of the supported families that compute the contract, and one that does not (Gemma's
    ``(1 + w)``)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeRMSNorm

    return [OlmoeRMSNorm, Qwen2MoeRMSNorm, MixtralRMSNorm], GemmaRMSNorm


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_installed_on_transformers_norms_that_agree_and_only_for_one_cpu_row(dtype, monkeypatch):
    monkeypatch.delenv(hostnorm.HOST_NORM_VAR, raising=False)
    same, other = _norm_classes()
    g = torch.Generator().manual_seed(1)
    for cls in same:
        mod = cls(96, eps=1e-6).to(dtype)
        with torch.no_grad():
            mod.weight.copy_(torch.randn(96, generator=g) * 0.3 + 1)
        own = cls.forward.__get__(mod)
        assert hostnorm.use_host_norms(mod) == 1 and hostnorm.use_host_norms(mod) == 0  # once
        calls = []
        real = hostnorm.rms_norm
        monkeypatch.setattr(hostnorm, "rms_norm", lambda *a: calls.append(1) or real(*a))
        with torch.inference_mode():
            x = (torch.randn(1, 1, 96, generator=g) * 4).to(dtype)
            got, want = mod(x), own(x)
            tol = (1 if dtype == torch.bfloat16 else 4) * torch.finfo(dtype).eps * want.float().abs()
            assert ((got.float() - want.float()).abs() <= tol).all(), cls.__name__
            assert len(calls) == 1
            xs = (torch.randn(1, 5, 96, generator=g) * 4).to(dtype)  # a prompt: the module's own forward
            assert torch.equal(mod(xs), own(xs)) and len(calls) == 1
            if dtype == torch.bfloat16:  # another dtype: its own forward
                assert torch.equal(mod(x.float()), own(x.float())) and len(calls) == 1
        monkeypatch.setattr(hostnorm, "rms_norm", real)
    gemma = other(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        gemma.weight.copy_(torch.randn(96, generator=g))
    assert hostnorm.use_host_norms(gemma) == 0  # computes x·(1 + w): the probe disagrees, left alone
    assert hostnorm.use_host_norms(torch.nn.LayerNorm(96)) == 0


def test_the_switch(monkeypatch):
    monkeypatch.delenv(hostnorm.HOST_NORM_VAR, raising=False)
    assert hostnorm.enabled() == compiled.AVAILABLE
    monkeypatch.setenv(hostnorm.HOST_NORM_VAR, "0")
    mod = _norm_classes()[0][0](32)
    assert not hostnorm.enabled() and hostnorm.use_host_norms(mod) == 0
    monkeypatch.setenv(hostnorm.HOST_NORM_VAR, "yes")
    with pytest.raises(ValueError, match="EXPERTCACHE_HOST_NORM must be 0 .* got 'yes'"):
        hostnorm.enabled()


@pytest.fixture(scope="module")
def tiny_olmoe(tmp_path_factory):
    from expertcache.models.tiny import save_tiny

    return save_tiny("olmoe", tmp_path_factory.mktemp("hostnorm") / "olmoe", seed=5)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_run_with_its_dense_part_quantised_takes_it_and_decodes_as_without(tiny_olmoe, tmp_path, monkeypatch, dtype):
    """The tiny OLMoE, int8 dense part on the CPU: every RMSNorm on the host norm (and the one-token steps calling
    it), logits close to the same run with $EXPERTCACHE_HOST_NORM=0 and the same greedy tokens; without a quantised
    dense part (int4 experts alone, or nothing quantised) no norm is touched -- those runs keep transformers' bits."""
    from conftest import decode_logits

    from expertcache.offload import OffloadConfig, OffloadedModel

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    calls = []
    real = hostnorm.rms_norm
    monkeypatch.setattr(hostnorm, "rms_norm", lambda *a: calls.append(1) or real(*a))
    out = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(hostnorm.HOST_NORM_VAR, switch)
        rt = OffloadedModel.from_pretrained(tiny_olmoe, OffloadConfig(quant_dense="int8", io="cached", readers=0),
                                            dtype=dtype)
        norms = [m for m in rt.model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert len(norms) == 4 * len(rt.layers) + 1  # OLMoE: input, post-attention, q and k a layer; the final one
        assert rt.host_norms == (len(norms) if switch == "1" else 0)
        made = len(calls)
        out[switch] = decode_logits(rt, ids, prefill=3)
        assert len(calls) - made == (5 * len(norms) if switch == "1" else 0)  # 5 one-token steps, every norm
        rt.close()
    a, b = out["1"].float(), out["0"].float()
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < (1e-3 if dtype == torch.float32 else 3e-2), rel
    assert (a[:, 3:].argmax(-1) == b[:, 3:].argmax(-1)).float().mean() >= 0.8
    monkeypatch.delenv(hostnorm.HOST_NORM_VAR)
    for cfg in (OffloadConfig(io="cached", readers=0), OffloadConfig(quant="int4", io="cached", readers=0)):
        rt = OffloadedModel.from_pretrained(tiny_olmoe, cfg, dtype=dtype)
        assert rt.host_norms == 0
        assert not any(isinstance(m.__dict__.get("forward"), hostnorm._HostNormForward) for m in rt.model.modules())
        rt.close()

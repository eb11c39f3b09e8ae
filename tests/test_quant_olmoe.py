"""OLMoE-architecture logits through the offloaded runtime with quantised experts (``quant``) and dense weights
(``quant_dense``), against an independent reference: transformers' ``OlmoeForCausalLM`` run in float32 with every
quantised matrix replaced by its plain dequantisation, written out here from the documented formulas
(offload/quant.py, offload/qlinear.py):

- experts (gate_up [2F, D], down [D, F] of every expert), int8: ``W = q·s`` with one scale per output row;
  int4: ``W = (q - 8)·s + z`` with one ``(s, z)`` per G consecutive columns, G = 64 (the default where it
  divides D and F, as in OLMoE-1B-7B);
- dense (``q/k/v/o_proj`` of every layer and ``lm_head``, in int8 or int4 with G = ``DENSE_GROUP``), the token
  embedding as int8 rows (``q·s`` per row); with tied embeddings ``lm_head`` and the embedding are quantised
  apart;

codes, scales and zeros from ``quantize_codes`` with scales in the compute dtype. What the fused kernels
promise is ``x @ dequant(W).T``: in float32 the runtime's logits equal the reference's up to summation order; in
bf16 (the checkpoint's dtype, as users run it) up to bf16 rounding. Then the quantised logits against the
unquantised bf16 model: within the error the weights themselves carry, and a deliberately wrong
dequantisation (scales of the neighbouring row / group) is outside that bound -- the bound has teeth.

The checkpoint has OLMoE-1B-7B's proportions at 1/8 of its width: D = 256, F = D/2, E = 16, top-8 (not
renormalised), head dim 64, 2 layers, bf16 safetensors; vocabulary 1152 = 1024 + 128 (as OLMoE's 50304 =
49 · 1024 + 128: lm_head and the embedding are taller than a block of 1024 rows, with a partial last block).
Weights are drawn so that every part of the path matters (std 1/sqrt(fan-in): each attention output measures
0.5-0.6 and each MoE output 0.33-0.37 of the norm of its normalised input -- not the 5 % of the MoE layers of
``bench --make-model``'s N(0, 0.02) checkpoints; embeddings std 1; a router of std 2/sqrt(D), decisive enough
that bf16 rounding does not flip the top-8)."""

from __future__ import annotations

import math

import pytest
import torch

from expertcache.offload.quant import quantize_codes


@pytest.fixture(autouse=True)
def embedding_held(monkeypatch):
    """These tests pin the quantised embedding (QuantEmbedding's rows): held, not read on demand
    (offload/diskembed.py, whose own tests are tests/test_disk_embedding.py)."""
    monkeypatch.setenv("EXPERTCACHE_EMBEDDING", "ram")


@pytest.fixture(autouse=True)
def _weight_only_int8_dense(monkeypatch):
    """These tests pin the weight-only contract (``x @ dequant(W).T``): ``--quant-dense int8`` on
    ``_weight_int8pack_mm`` here, and the int4 experts on torch's int4 kernel; FBGEMM's int8-activation paths and
    q4x8 (the AVX2 default, and AVX-512's with one torch thread, as here) have their own tests
    (test_quant_kernels.py, test_fbexperts.py, test_q4x8.py, test_q4x8_dense.py)."""
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "int8pack")
    monkeypatch.setenv("EXPERTCACHE_EXPERT_KERNEL", "int4pack")
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT4_KERNEL", "int4pack")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, F, E, TOP_K, LAYERS, V = 256, 128, 16, 8, 2, 1152
EXPERT_GROUP = 64  # offload/quant.py default_group: 64 where it divides D and F
#: bf16's unit roundoff is 2^-9; the runtime rounds every projection, attention and expert output to bf16 --
#: some tens of independent roundings on a token's path, adding in quadrature (~sqrt(16) · 2^-9 ≈ 0.8 %;
#: the unquantised bf16 runtime against float32 measures 0.6 %). Bound: 2^-6 = 8 units.
BF16_REL = 2 ** -6
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _write_olmoe(path, tied: bool):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS,
                         num_attention_heads=D // 64, num_key_value_heads=D // 64, num_experts=E,
                         num_experts_per_tok=TOP_K, norm_topk_prob=False, max_position_embeddings=256,
                         tie_word_embeddings=tied, rms_norm_eps=1e-5, pad_token_id=1, bos_token_id=None,
                         eos_token_id=2)
    model = OlmoeForCausalLM(config)
    g = torch.Generator().manual_seed(11 + tied)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue  # ones
            std = (1.0 if "embed_tokens" in name else 2 / D ** 0.5 if name.endswith("mlp.gate.weight")
                   else p.shape[-1] ** -0.5)  # fan-in: the last dim of every [.., N, K] weight
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def olmoe(request, tmp_path_factory):
    """The checkpoint's folder; ``request.param``: tied embeddings (parametrised indirectly, by the tests)."""
    return _write_olmoe(tmp_path_factory.mktemp("olmoe-q") / "m", request.param)


PROMPT = torch.randint(3, V, (2, 16), generator=torch.Generator().manual_seed(5))  # 32 positions
PREFILL = 8  # then 8 one-token decode steps per row: both the batched and the one-token step


def _dequant(w_NK: torch.Tensor, mode: str, group: int, dtype: torch.dtype, wrong: bool = False) -> torch.Tensor:
    """The plain dequantisation of ``w_NK``'s codes (float64): int8 ``q·s`` per row; int4 ``(q - 8)·s + z``,
    one (s, z) per ``group`` columns. ``wrong``: each row (int8) or group (int4) takes its neighbour's scale
    (and zero) -- an indexing slip a test of these logits must catch."""
    q, s, z = quantize_codes(w_NK.float(), mode, group, dtype)
    q, s = q.double(), s.double()
    if mode == "int8":
        return q * (s.roll(1, 0) if wrong else s)[:, None]
    z = z.double()
    if wrong:
        s, z = s.roll(1, 1), z.roll(1, 1)
    return (q - 8) * s.repeat_interleave(group, dim=1) + z.repeat_interleave(group, dim=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _reference(path, quant, quant_dense, dtype, *, wrong_experts=False, wrong_dense=False):
    """(float32 transformers model with every quantised matrix dequantised, {matrix kind: largest relative
    weight error}) -- ``dtype``: the compute dtype the scales were rounded to."""
    from transformers import OlmoeForCausalLM

    from expertcache.offload.qlinear import DENSE_GROUP

    ref = OlmoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eps: dict[str, float] = {}

    def swap(kind, w, mode, group, wrong):
        w_hat = _dequant(w, mode, group, dtype, wrong)
        eps[kind] = max(eps.get(kind, 0.0), _rel(w_hat, w))
        return w_hat.float()

    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            if quant:
                ex = layer.mlp.experts  # gate_up_proj [E, 2F, D], down_proj [E, D, F]
                for e in range(E):
                    ex.gate_up_proj[e] = swap(f"experts.{i}.gate_up", ex.gate_up_proj[e], quant, EXPERT_GROUP,
                                              wrong_experts)
                    ex.down_proj[e] = swap(f"experts.{i}.down", ex.down_proj[e], quant, EXPERT_GROUP, wrong_experts)
            if quant_dense:
                for name in ATTN:
                    lin = getattr(layer.self_attn, name)
                    lin.weight.copy_(swap(f"{i}.{name}", lin.weight, quant_dense, DENSE_GROUP, wrong_dense))
        if quant_dense:  # new tensors: with tied embeddings lm_head and the embedding become two
            emb = ref.model.embed_tokens.weight.detach()
            head = emb if ref.config.tie_word_embeddings else ref.lm_head.weight.detach()
            ref.lm_head.weight = torch.nn.Parameter(swap("lm_head", head, quant_dense, DENSE_GROUP, wrong_dense))
            ref.model.embed_tokens.weight = torch.nn.Parameter(swap("embed", emb, "int8", 1, wrong_dense))
    return ref, eps


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits.float()


def _runtime_logits(path, quant, quant_dense, dtype) -> torch.Tensor:
    from conftest import decode_logits

    from expertcache.offload import OffloadConfig, OffloadedModel

    rt = OffloadedModel.from_pretrained(path, OffloadConfig(io="cached", readers=0, capacity=E // 2, quant=quant,
                                                            quant_dense=quant_dense), dtype=dtype)
    return decode_logits(rt, PROMPT, prefill=PREFILL).float()


# (tied, experts, dense): every pair untied; tied embeddings (lm_head and the embedding quantised apart) with
# int8 and int4 throughout by default, the other four with -m slow
CONFIGS = [pytest.param(tied, q, d, id=f"{'tied' if tied else 'untied'}-{q}-{d}",
                        marks=[pytest.mark.slow] if tied and (q, d) not in (("int8", "int8"), ("int4", "int4")) else [])
           for tied in (False, True) for q in ("int8", "int4") for d in (None, "int8", "int4")]


@pytest.mark.parametrize("olmoe,quant,quant_dense", CONFIGS, indirect=["olmoe"])
def test_float32_logits_equal_the_dequantised_model(olmoe, quant, quant_dense):
    """float32: the fused kernels compute ``x @ dequant(W).T`` exactly up to summation order (2^-24 per
    operation over sums of 256 terms, a few layers deep): 1e-5 of the largest logit bounds every logit."""
    got = _runtime_logits(olmoe, quant, quant_dense, torch.float32)
    want = _logits(_reference(olmoe, quant, quant_dense, torch.float32)[0])
    assert got.shape == want.shape == (*PROMPT.shape, V)
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), (err, want.abs().max().item())


@pytest.mark.parametrize("olmoe,quant,quant_dense", CONFIGS, indirect=["olmoe"])
def test_bf16_logits_match_the_dequantised_model_and_stay_near_the_bf16_model(olmoe, quant, quant_dense):
    """bf16, the checkpoint's dtype:

    1. against the dequantised float32 model: within bf16 rounding (:data:`BF16_REL` relative L2, and no logit
       off by more than 4 × that of the largest) -- while the same model with the neighbouring row's / group's
       scales is far outside it;
    2. against the unquantised model (the bf16 weights, float32 compute): relative L2 error within
       ``sqrt(sum of eps_i^2 + BF16_REL^2)``, eps_i the relative (Frobenius) error of each quantised product on a
       token's path (per layer: the experts' gate_up and down, the largest over experts, and q/k/v/o; then
       lm_head and the embedding). Each sublayer's output error enters the residual stream at most at its
       own relative size (the stream holds the embedding and every earlier output besides) and independent
       errors add in quadrature. A wrong dequantisation of the experts (or of the dense weights) breaks this
       bound -- except wrong int8 experts under int4 dense weights, whose larger error hides them;
    3. top-1 agreement with the unquantised model wherever it is implied by that bound: at every position whose
       top-1 margin exceeds 6 standard deviations of the difference of two logits' errors (each logit's error
       of rms ``bound`` × the row's rms logit), the top-1 token is the same. Random logits have small margins:
       untied, int8 throughout leaves half of the positions or more that sure and int4 almost none; with tied
       embeddings the input token's own logit stands out and every position is (a gross error still flips
       them)."""
    got = _runtime_logits(olmoe, quant, quant_dense, torch.bfloat16)
    ref, eps = _reference(olmoe, quant, quant_dense, torch.bfloat16)
    want = _logits(ref)
    rel = _rel(got, want)
    assert rel <= BF16_REL, rel
    assert (got - want).abs().max().item() <= 4 * BF16_REL * want.abs().max().item()
    wrong_e = _logits(_reference(olmoe, quant, quant_dense, torch.bfloat16, wrong_experts=True)[0])
    assert _rel(wrong_e, want) > 4 * BF16_REL

    from transformers import OlmoeForCausalLM

    base = _logits(OlmoeForCausalLM.from_pretrained(olmoe, dtype=torch.float32).eval())
    n_attn = len(ATTN) * LAYERS + 2 if quant_dense else 0
    assert len(eps) == 2 * LAYERS + n_attn
    bound = math.sqrt(sum(e * e for e in eps.values()) + BF16_REL ** 2)
    assert _rel(got, base) <= bound, (_rel(got, base), bound, eps)
    if not (quant == "int8" and quant_dense == "int4"):
        assert _rel(wrong_e, base) > bound, (_rel(wrong_e, base), bound)
    top2 = base.topk(2, dim=-1).values  # [B, S, 2]
    sure = top2[..., 0] - top2[..., 1] > 6 * math.sqrt(2) * bound * base.pow(2).mean(-1).sqrt()  # [B, S]
    assert torch.equal(got.argmax(-1)[sure], base.argmax(-1)[sure]), int(sure.sum())
    if quant_dense:
        wrong_d = _logits(_reference(olmoe, quant, quant_dense, torch.bfloat16, wrong_dense=True)[0])
        assert _rel(wrong_d, base) > bound, (_rel(wrong_d, base), bound)

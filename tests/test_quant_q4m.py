"""``--quant q4m`` / ``--quant-dense int4-head8``: per-tensor precision like llama.cpp's Q4_K_M (attention and the
embedding int4, lm_head int8), checked against independent computations."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def embedding_held(monkeypatch):
    """These tests pin the quantised embedding (QuantEmbedding's rows): held, not read on demand
    (offload/diskembed.py, whose own tests are tests/test_disk_embedding.py)."""
    monkeypatch.setenv("EXPERTCACHE_EMBEDDING", "ram")


def _int4_rows_by_hand(w, group):
    """min/max int4 of each group of ``group`` columns, float32: s = (max - min) / 15, z = min + 8 s,
    q = clamp(round((w - z) / s) + 8, 0, 15); returns the dequantised table (q - 8) s + z."""
    v, d = w.shape
    g = w.reshape(v, d // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    s = torch.where(s == 0, torch.ones_like(s), s)
    z = lo + 8 * s
    q = (torch.round((g - z) / s) + 8).clamp(0, 15)
    return ((q - 8) * s + z).reshape(v, d)


def test_int4_embedding_rows_are_the_documented_codes_at_half_a_byte():
    from expertcache.offload.qlinear import DENSE_GROUP, QuantEmbedding

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 128, generator=gen) * torch.rand(300, 1, generator=gen)  # rows of different scales
    emb = torch.nn.Embedding(300, 128)
    emb.weight.data.copy_(w)
    q = QuantEmbedding.from_embedding(emb, "int4")
    ids = torch.tensor([[0, 5, 299], [17, 17, 1]])
    want = _int4_rows_by_hand(w, DENSE_GROUP)[ids]
    assert torch.allclose(q(ids), want, atol=1e-6, rtol=1e-5)
    assert (q(ids) - w[ids]).abs().max() > 0  # quantised, not copied
    nbytes = sum(b.numel() * b.element_size() for b in q.buffers())
    assert nbytes == 300 * 128 // 2 + 2 * 300 * (128 // 32) * 4  # codes two a byte, a scale and a zero per group


def _olmoe(path, hidden):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("olmoe", vocab_size=700, hidden_size=hidden, intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def test_int4_head8_puts_lm_head_at_int8_and_the_rest_at_int4_and_counts_its_bytes(tmp_path):
    from transformers import AutoModelForCausalLM

    from expertcache.models.loader import load_config_checked
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.qlinear import QuantEmbedding, QuantLinear, dense_bytes
    from expertcache.offload.quant import resolve_preset

    assert resolve_preset(OffloadConfig(quant="q4m")) == OffloadConfig(quant="int4", quant_dense="int4-head8",
                                                                       quant_opt="lsq")
    path = _olmoe(tmp_path / "m", 64)
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant="q4m"), dtype=torch.bfloat16)
    mods = dict(rt.model.named_modules())
    assert isinstance(mods["lm_head"], QuantLinear) and mods["lm_head"].qm.mode == "int8"
    # weight-only (bf16 activations) on the sensitive head, or q8x8 (activations 8-bit per 32 values) where FBGEMM's
    # would be 7-bit: never FBGEMM's one scale per token
    from expertcache.offload.qlinear import int8_kernel

    assert mods["lm_head"].kernel == int8_kernel(weight_only=True) and mods["lm_head"].kernel in ("int8pack", "q8x8")
    assert mods["model.layers.0.self_attn.v_proj"].qm.mode == "int4"
    assert isinstance(mods["model.embed_tokens"], QuantEmbedding) and mods["model.embed_tokens"].mode == "int4"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(load_config_checked(path), dtype=torch.bfloat16)
    assert dense_bytes(skeleton, "int4-head8") == rt.plan.non_expert_bytes
    # the embedding by hand: 700 × 64 codes at 4 bits + a bf16 scale and zero per 32 columns
    emb = mods["model.embed_tokens"]
    assert sum(b.numel() * b.element_size() for b in emb.buffers()) == 700 * 32 + 2 * 700 * 2 * 2
    with torch.inference_mode():
        logits = rt.forward(torch.tensor([[3, 4, 5, 6]])).logits
    assert torch.isfinite(logits.float()).all()
    rt.close()


def test_an_embedding_int4_cannot_group_stays_int8_rows(tmp_path):
    from transformers import AutoModelForCausalLM

    from expertcache.models.loader import load_config_checked
    from expertcache.offload.qlinear import QuantEmbedding, quantize_dense_skeleton

    path = _olmoe(tmp_path / "m", 48)  # D = 48: not whole pairs of 32-column groups (granular: 144)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(load_config_checked(path), dtype=torch.bfloat16)
    packed = quantize_dense_skeleton(skeleton, "int4-head8", "cpu")
    emb = packed["model.embed_tokens.weight"]
    assert isinstance(emb, QuantEmbedding) and emb.mode == "int8"
    assert packed["lm_head.weight"].qm.mode == "int8" and packed["model.layers.0.self_attn.q_proj.weight"].qm.mode == "int4"


def test_int4_head8_is_read_back_from_the_dense_cache_bit_for_bit(tmp_path, monkeypatch):
    """A second start reads the packed dense part (int4 embedding rows with their zeros included) from
    $EXPERTCACHE_CACHE/dense instead of packing it again, with the same logits."""
    from expertcache.offload import OffloadConfig, OffloadedModel

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))  # empty: the first start writes
    path = _olmoe(tmp_path / "m", 64)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    got = []
    for _ in range(2):
        rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant="q4m"), dtype=torch.bfloat16)
        with torch.inference_mode():
            got.append((rt.forward(ids).logits.float(), rt.describe()["dense_load"].get("dense_cache")))
        rt.close()
    assert [g[1] for g in got] == ["written", "read"]
    assert torch.equal(got[0][0], got[1][0])

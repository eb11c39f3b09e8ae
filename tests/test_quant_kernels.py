"""Quantised weights in the fused kernels' layouts (offload/quant.py, offload/qlinear.py, the sidecar in
offload/store.py): the packed bytes hold the codes a plain dequantisation reads, the fused product is
``x @ dequant(W).T`` for every shape class (aligned, K padded, N padded), a miss is one blob read into a slot and
nothing else, sidecars of the old format are rebuilt or refused, and ``--quant-dense`` keeps the logits within
what its weight error allows."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload.quant import (KERNEL_GROUPS, QuantLayout, QuantMatrix, kernel_for, pack_expert, pack_matrix,
                                       qmm, quant_mlp, quantize_codes)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (mode, N, K, G): aligned; K padded (the shipped D = 144, F = 104); N padded (int4: N % 16)
@pytest.fixture(autouse=True)
def embedding_held(monkeypatch):
    """These tests pin the quantised embedding (QuantEmbedding's rows): held, not read on demand
    (offload/diskembed.py, whose own tests are tests/test_disk_embedding.py)."""
    monkeypatch.setenv("EXPERTCACHE_EMBEDDING", "ram")


SHAPES = [("int4", 64, 128, 32), ("int4", 32, 256, 64), ("int4", 48, 256, 128), ("int4", 16, 512, 256),
          ("int4", 208, 144, 32), ("int4", 144, 104, 32), ("int4", 40, 96, 64),
          ("int8", 64, 128, 32), ("int8", 144, 104, 32), ("int8", 20, 24, 32)]


def _plain_dequant(q, s, z, mode, group):
    """W from codes, written out from the formulas (independent of the kernels): int8 q·s per row;
    int4 (q - 8)·s + z with one (s, z) per G consecutive columns."""
    q = q.double()
    if mode == "int8":
        return q * s.double()[:, None]
    s_full = s.double().repeat_interleave(group, dim=1)
    z_full = z.double().repeat_interleave(group, dim=1)
    return (q - 8) * s_full + z_full


def _weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :8] = 0.3  # a constant run and an outlier: groups of very different ranges
    w[1 % n, 3] = -1.0
    return w


@pytest.mark.parametrize("mode,n,k,group", SHAPES)
def test_codes_are_a_nearest_rounding(mode, n, k, group):
    """Every weight is within half a step of its code's value (the stored scale and zero applied in float64),
    codes in range -- checked per element from the formulas."""
    kp = -(-k // (group if mode == "int4" else 16)) * (group if mode == "int4" else 16)
    w = F.pad(_weights(n, k, 1), (0, kp - k))
    q, s, z = quantize_codes(w, mode, group, torch.float32)
    lo, hi = (-127, 127) if mode == "int8" else (0, 15)
    assert q.min() >= lo and q.max() <= hi
    step = s.double()[:, None] if mode == "int8" else s.double().repeat_interleave(group, dim=1)
    err = (w.double() - _plain_dequant(q, s, z, mode, group)).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-7).all()), float((err / step).max())


@pytest.mark.parametrize("mode,n,k,group", SHAPES)
def test_packed_layout_holds_the_codes(mode, n, k, group):
    """The kernel applied to the identity reads back exactly the plain dequantisation of the codes (fp32: exact
    products), padded rows and columns included: the packing is the kernel's layout of those codes."""
    qm = QuantMatrix(mode, kernel_for(mode), n, k, group, torch.float32)
    w = _weights(n, k, 2)
    weight, scales = pack_matrix(w, qm)
    q, s, z = quantize_codes(F.pad(w[None], (0, qm.k_pad - k), mode="replicate")[0], mode, group, torch.float32)
    got_KN = qmm(torch.eye(qm.k_pad), weight, scales, qm)  # row i: W[:, i]
    want = _plain_dequant(q, s, z, mode, group).float()  # [n, k_pad]
    assert got_KN.shape == (qm.k_pad, n)
    torch.testing.assert_close(got_KN.T, want, rtol=1e-6, atol=1e-7)
    # and the real columns are the weights within half a step
    step = (s[:, None] if mode == "int8" else s.repeat_interleave(group, dim=1))[:, :k]
    assert bool(((got_KN.T[:, :k] - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("mode,n,k,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_fused_product_equals_x_times_dequantised_weight(mode, n, k, group, dtype, m):
    qm = QuantMatrix(mode, kernel_for(mode), n, k, group, dtype)
    w = _weights(n, k, 3)
    weight, scales = pack_matrix(w, qm)
    q, sc, z = quantize_codes(F.pad(w[None], (0, qm.k_pad - k), mode="replicate")[0], mode, group, dtype)
    w_hat = _plain_dequant(q, sc, z, mode, group)[:, :k]  # the codes the packing holds (test above)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = qmm(x, weight, scales, qm)
    assert got.shape == (m, n) and got.dtype == dtype
    ref = x.double() @ w_hat.double().T
    # fp32: accumulation order only; bf16: the inputs' and output's rounding (2^-8 relative) plus the scales'
    # rounding to bf16 (another 2^-8 of each weight), over a sum of k terms
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    scale = (x.double().abs() @ w_hat.double().abs().T).max().item()
    assert (got.double() - ref).abs().max().item() <= tol * scale, ((got.double() - ref).abs().max().item(), scale)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("d,f", [(64, 128), (144, 104), (144, 416)])
def test_expert_mlp_on_a_blob(mode, d, f):
    """The quantised MLP of one packed expert = down(silu(gate) * up) with the dequantised matrices (read back
    through the kernel from the identity), and stays within the quantisation error of the bf16 expert."""
    g = torch.Generator().manual_seed(5)
    gu, down = torch.randn(2 * f, d, generator=g) * 0.05, torch.randn(d, f, generator=g) * 0.05
    layout = QuantLayout(mode, d, f, 32, torch.float32)
    blob = pack_expert(gu, down, layout)
    assert blob.dtype == torch.uint8 and blob.numel() == layout.nbytes
    views = layout.views(blob)
    assert all(v.untyped_storage().data_ptr() == blob.untyped_storage().data_ptr() for v in views)  # no copies
    x = torch.randn(3, d, generator=g)
    got = quant_mlp(layout, F.silu)(x, views)
    gu_hat = qmm(torch.eye(layout.gate_up.k_pad), views[0], views[1], layout.gate_up).T[:, :d]  # [2Fp, D]
    dn_hat = qmm(torch.eye(layout.down.k_pad), views[2], views[3], layout.down).T  # [D, Fp]
    fp = layout.f_pad
    assert not gu_hat[f:fp].any() and not gu_hat[fp + f:].any()  # padded rows compute zeros
    gate, up = (x @ gu_hat.T).chunk(2, dim=-1)
    torch.testing.assert_close(got, (F.silu(gate) * up) @ dn_hat.T, rtol=1e-5, atol=1e-6)
    gate0, up0 = (x @ gu.T).chunk(2, dim=-1)
    ref = (F.silu(gate0) * up0) @ down.T
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < (0.03 if mode == "int8" else 0.3), rel


def test_int4_group_must_be_a_kernel_group():
    with pytest.raises(ValueError, match="--group"):
        QuantLayout("int4", 64, 64, 16)
    assert all(QuantLayout("int4", 64, 64, g).group == g for g in KERNEL_GROUPS)


def test_layout_of_another_cpu_capability_is_refused():
    """The int4 CPU packing is a permutation that depends on the vector width: packing for another
    capability's layout name is refused, never silently mislabelled."""
    qm = QuantMatrix("int4", "cpu-some-other-isa", 32, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="cannot be packed on this CPU"):
        pack_matrix(torch.zeros(32, 64), qm)


# -- the runtime: one read per miss, old sidecars --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_olmoe(tmp_path_factory):
    from expertcache.models.tiny import save_tiny

    return save_tiny("olmoe", tmp_path_factory.mktemp("qk") / "olmoe", seed=3)


def _rt(path, **kw):
    from expertcache.offload import OffloadConfig, OffloadedModel

    dtype = kw.pop("dtype", torch.float32)
    return OffloadedModel.from_pretrained(path, OffloadConfig(**{"io": "cached", "readers": 0, **kw}), dtype=dtype)


def test_a_miss_is_one_blob_read_into_a_slot_and_nothing_else(tiny_olmoe, monkeypatch):
    from expertcache.offload import quant, store

    rt = _rt(tiny_olmoe, quant="int4", capacity=2)
    parts = rt._parts[(0, 0)]
    assert len(parts.reads) == 1 and parts.nbytes == rt.source.quant.nbytes == rt.expert_bytes
    reads = []
    real_read = store.DiskTier.read

    def counting_read(self, parts, placement, buf):
        reads.append((parts.reads, buf.data_ptr()))
        return real_read(self, parts, placement, buf)

    def forbidden(*a, **k):
        raise AssertionError("quantisation or packing on the miss path")

    monkeypatch.setattr(store.DiskTier, "read", counting_read)
    for name in ("quantize_codes", "pack_matrix", "pack_expert"):
        monkeypatch.setattr(quant, name, forbidden)
    slot_ptrs = {rt.arena.buffer[i].data_ptr() for i in range(rt.arena.buffer.shape[0])}
    with torch.inference_mode():
        rt.generate(torch.tensor([[3, 5, 7, 9]]), 4)
    s = rt.stats()
    assert s["misses"] > 0 and len(reads) == s["expert_loads"] == s["misses"]
    assert s["bytes_read"] == s["misses"] * rt.expert_bytes  # the blob, nothing more
    assert all(len(r) == 1 and ptr in slot_ptrs for r, ptr in reads)  # one range, straight into a slot


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_offloaded_quantised_logits_equal_the_model_with_dequantised_experts(tiny_olmoe, mode, monkeypatch):
    """Every capacity, prefill (several tokens: the batched step) then one-token decode (the one-token step):
    the offloaded int8/int4 logits equal the in-memory transformers model whose experts are replaced by the
    sidecar's dequantised matrices (read back through the kernel from the identity), fp32 -- so the runtime
    computes each used expert with exactly the packed weights, whatever the residency. torch's int4 kernel
    (an AVX2 CPU would run C = N on FBGEMM's re-quantised copies: tests/test_fbexperts.py)."""
    from conftest import decode_logits

    from expertcache.models import load_model
    from expertcache.offload.quant import EXPERT_KERNEL_VAR

    monkeypatch.setenv(EXPERT_KERNEL_VAR, "int4pack")

    rt = _rt(tiny_olmoe, quant=mode, capacity=None)
    layout = rt.source.quant
    ref = load_model(tiny_olmoe)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    with torch.no_grad():
        for m in rt.layers:
            experts = ref.model.layers[m.layer_id].mlp.experts
            for e in range(rt.num_experts):
                rt.tier.fetch(rt._parts[(m.index, e)], buf)  # the blob, as a miss reads it
                v = layout.views(buf)
                gu = qmm(torch.eye(layout.gate_up.k_pad), v[0], v[1], layout.gate_up).T[:, :layout.d]
                dn = qmm(torch.eye(layout.down.k_pad), v[2], v[3], layout.down).T[:, :layout.f]
                fp, f = layout.f_pad, layout.f
                experts.gate_up_proj[e].copy_(torch.cat([gu[:f], gu[fp:fp + f]]))
                experts.down_proj[e].copy_(dn)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = ref(ids).logits
    for c in (1, 3, rt.num_experts):
        rt.configure(capacity=c)
        torch.testing.assert_close(decode_logits(rt, ids, prefill=3), want, rtol=1e-4, atol=1e-4)


def _rewrite_metadata(path, change):
    """The safetensors file at ``path`` with its ``__metadata__`` changed by ``change(dict)`` (data kept)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    change(header["__metadata__"])
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_old_format_sidecars_are_rebuilt_in_the_cache_and_refused_next_to_the_model(tiny_olmoe, tmp_path,
                                                                                        monkeypatch, capsys):
    from expertcache.offload import store
    from expertcache.offload.checkpoint import CheckpointError

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "_VERIFIED", set())
    model = tmp_path / "m"
    shutil.copytree(tiny_olmoe, model)
    ids = torch.tensor([[3, 5, 7]])
    rt = _rt(model, quant="int8")
    with torch.inference_mode():
        want = rt.generate(ids, 3)["tokens"]
    side = rt.source.path
    assert side.parent == tmp_path / "cache" / "quant" and "-v2-int8-plain-float32" in side.name

    def to_v1(meta):  # what format 1 wrote: mode and group, no format_version, no kernel
        for k in ("format_version", "kernel", "dtype"):
            meta.pop(k)

    _rewrite_metadata(side, to_v1)
    store._VERIFIED.clear()
    rt = _rt(model, quant="int8")  # the cache's copy: rebuilt, with a note
    err = capsys.readouterr().err
    assert "format 1" in err and "rebuilding" in err, err
    with torch.inference_mode():
        assert torch.equal(rt.generate(ids, 3)["tokens"], want)
    store.check_sidecar_layout(side, rt.source.quant)  # rewritten in format 2
    # next to the model (never rewritten by expertcache): refused, naming the file and the format
    local = model / side.name.split("-", 2)[-1]
    shutil.copy(side, local)
    _rewrite_metadata(local, to_v1)
    with pytest.raises(CheckpointError, match=r"format 1 .*delete the file"):
        _rt(model, quant="int8")
    # another kernel layout (an int4 sidecar packed for another CPU) is refused the same way
    with pytest.raises(CheckpointError, match="another layout"):
        store.check_sidecar_layout(side, dataclasses.replace(rt.source.quant, dtype=torch.bfloat16))


# -- the dense weights (--quant-dense) --------------------------------------------------------------------


def _read_back(mod) -> torch.Tensor:
    """The weight a QuantLinear computes with, read through its forward from the identity (fp32 out; the rows of
    the identity are exact in any activation quantisation, so FBGEMM's int8 × int8 reads back its weight too)."""
    eye = torch.eye(mod.in_features, dtype=mod.scales.dtype)
    return (mod(eye) - (mod.bias if mod.bias is not None else 0)).T.float()


@pytest.mark.parametrize("mode,agree", [("int8", 0.9), ("int4", 0.7)])
def test_dense_quantisation_keeps_logits_within_its_weight_error(mode, agree, monkeypatch):
    """Shipped granular model, experts bf16, attention + lm_head quantised (weight-only kernels: int8 on
    ``_weight_int8pack_mm``, FBGEMM's int8-activation path has its own test), embedding int8 rows. Tolerance
    from the weights themselves: ε = the largest relative (Frobenius) error of a quantised matrix, read back
    through its kernel; the logits carry one such error per quantised product on the path (4 layers × 4
    projections + lm_head + the embedding = 18, independent: they add in quadrature, √18 ≈ 4.2), so their
    relative error stays under 4.5 ε. Greedy tokens (argmax per position) mostly agree."""
    from tokenizers import Tokenizer

    from expertcache.models.loader import resolve_model_path
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.qlinear import QuantEmbedding, QuantLinear, dense_targets

    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "int8pack")
    path = resolve_model_path("granular")
    ids = torch.tensor([Tokenizer.from_file(str(path / "tokenizer.json")).encode(
        (path / "MODEL_CARD.md").read_text()[:1500]).ids[:64]])
    ref_rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host"))
    bf16 = {n: m.weight.detach().float().clone() for n, m in dense_targets(ref_rt.model).items()}
    with torch.inference_mode():
        want = ref_rt.forward(ids).logits[0].float()
    del ref_rt
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant_dense=mode))
    eps = []
    for name, w in bf16.items():
        mod = rt.model.get_submodule(name)
        if isinstance(mod, QuantEmbedding):
            got = mod.codes.float() * mod.scales.float()[:, None]
            assert bool(((got - w).abs() <= mod.scales.float()[:, None] / 2 * 1.01 + 1e-8).all())  # int8 rows
        else:
            assert isinstance(mod, QuantLinear) and mod.qm.mode == mode
            got = _read_back(mod)
        eps.append(((got - w).norm() / w.norm()).item())
    assert len(eps) == 4 * 4 + 2  # q, k, v, o of 4 layers, lm_head, embedding (tied: two copies)
    with torch.inference_mode():
        got = rt.forward(ids).logits[0].float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 4.5 * max(eps), (rel, max(eps))
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= agree


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="torch without FBGEMM")
@pytest.mark.parametrize("reduce_range", [True, False])
@pytest.mark.parametrize("n,k", [(144, 144), (1000, 104), (50, 2048)])
def test_fbgemm_int8_dense_error_is_weight_plus_activation_step(n, k, reduce_range, monkeypatch):
    """The FBGEMM int8 dense product against the weight-only int8 one (same codes and scales): the difference is
    the activation's quantisation alone, per token (7 or 8 bits: 127 / 255 steps over [-max, max] of the row after
    its scaling to max 1). Its relative size per row is at most about ``2·max|x| / (levels·√12·rms(x))`` (uniform
    rounding noise, √K-averaged like the signal): 1.5× that bound holds, for rows of very different scales in one
    call (the per-token scaling keeps the small rows' precision)."""
    from expertcache.offload.qlinear import QuantLinear

    from expertcache.offload.quant import fbgemm_vnni

    if not reduce_range and not fbgemm_vnni():
        pytest.skip("8-bit activations on AVX2's vpmaddubsw saturate int16 (why FBGEMM's reduce_range exists)")
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "fbgemm")  # q8x8 is the AVX2 default: tests/test_q8x8.py
    g = torch.Generator().manual_seed(n + k)
    lin = torch.nn.Linear(k, n, bias=True).float()
    lin.weight.data = torch.randn(n, k, generator=g) * 0.05
    lin.bias.data = torch.randn(n, generator=g)
    q = QuantLinear.from_linear(lin, "int8")
    assert q.kernel == "fbgemm" and q._fbgemm is not None and q.qweight.numel() == 0
    q.reduce_range = reduce_range
    ref = QuantLinear(n, k, "int8", torch.float32, bias=True)
    ref.kernel = "int8pack"
    ref.load_rows(lambda a, b: lin.weight.detach()[a:b])
    ref.bias.data.copy_(lin.bias.detach())
    x = torch.randn(8, k, generator=g) * torch.logspace(-3, 2, 8)[:, None]  # rows 5 decades apart
    got, want = q(x), ref(x)
    levels = 127 if reduce_range else 255
    w_rms = (want - lin.bias).norm(dim=-1)
    bound = 2 * x.abs().amax(-1) / (levels * 12 ** 0.5 * x.pow(2).mean(-1).sqrt())
    rel = (got - want).norm(dim=-1) / w_rms
    assert bool((rel <= 1.5 * bound).all()), (rel, bound)
    assert q(x[:1]).shape == (1, n) and torch.allclose(q(x[None]), got[None])  # leading shapes kept


def test_fbgemm_int8_dense_keeps_greedy_tokens():
    """Shipped granular model with ``--quant-dense int8`` on FBGEMM (attention + lm_head): the logits' relative error
    stays under 6 % and greedy tokens agree at ≥ 85 % of 64 positions of the model card (measured here: 2.5 % and
    95 % with 8-bit activations, 4.4 % and 88 % with 7-bit)."""
    from tokenizers import Tokenizer

    from expertcache.models.loader import resolve_model_path
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.qlinear import QuantLinear

    path = resolve_model_path("granular")
    ids = torch.tensor([Tokenizer.from_file(str(path / "tokenizer.json")).encode(
        (path / "MODEL_CARD.md").read_text()[:1500]).ids[:64]])
    with torch.inference_mode():
        want = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host")).forward(ids).logits[0].float()
        rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant_dense="int8"))
        kernels = {m.kernel for m in rt.model.modules() if isinstance(m, QuantLinear)}
        if kernels != {"fbgemm"}:
            pytest.skip(f"int8 dense kernels here: {kernels}")
        got = rt.forward(ids).logits[0].float()
    assert ((got - want).norm() / want.norm()).item() < 0.06
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.85


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("n,k,rows", [(1000, 144, 64), (2500, 256, 1024), (3072, 64, 1024), (16, 64, 64)])
def test_packing_in_row_blocks_equals_packing_the_whole_matrix(mode, n, k, rows):
    """``pack_matrix_into`` (the loader's path: a block of rows at a time) gives the bytes ``pack_matrix`` gives
    for the whole matrix -- also where the last block is short and carries the row padding (n = 1000, 2500)."""
    from expertcache.offload.quant import pack_matrix_into

    qm = QuantMatrix(mode, kernel_for(mode), n, k, 32, torch.bfloat16)
    w = _weights(n, k, seed=n).to(torch.bfloat16)
    whole_w, whole_s = pack_matrix(w.float(), qm)
    (ws, wd), (ss, sd) = qm.shapes()
    got_w, got_s = torch.full(ws, 7, dtype=wd), torch.full(ss, 7, dtype=sd)  # not zeros: every byte written
    asked = []
    pack_matrix_into(lambda a, b: asked.append(b - a) or w[a:b], qm, got_w, got_s, rows=rows)
    assert torch.equal(got_w, whole_w) and torch.equal(got_s, whole_s)
    assert max(asked) <= rows and sum(asked) == n


def _olmoe_dense_checkpoint(path, tied):
    """A random OLMoE checkpoint whose vocabulary (2500) spans three row blocks, the last one short."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("olmoe", vocab_size=2500, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               tie_word_embeddings=tied)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quant_dense_packs_straight_from_the_checkpoint(tmp_path, monkeypatch, mode, tied):
    """With ``--quant-dense`` no quantised matrix is ever read whole: every read of its key is at most
    PACK_ROWS rows (the loading peak is the quantised model plus one block), and the packed buffers equal
    ``pack_matrix`` of the stored weight read independently (safetensors); the embedding's int8 rows are the
    documented ``round(w / s)``, ``s = max|row| / 127`` (1 for a zero row). Tied: ``lm_head`` is packed from the embedding's key."""
    from safetensors.torch import load_file

    from expertcache.offload.checkpoint import Checkpoint
    from expertcache.offload.qlinear import QuantEmbedding, QuantLinear
    from expertcache.offload.quant import PACK_ROWS

    path = _olmoe_dense_checkpoint(tmp_path / "m", tied)
    stored = load_file(str(path / "model.safetensors"))
    reads, real = [], Checkpoint.tensor

    def spy(self, key, rows=None):
        t = real(self, key, rows)
        reads.append((key, t.shape[0] if t.dim() else 0, rows is not None))
        return t

    monkeypatch.setattr(Checkpoint, "tensor", spy)
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "int8pack")  # buffers kept
    rt = _rt(path, tier="host", quant_dense=mode, dtype=torch.bfloat16)
    targets = {n: m for n, m in rt.model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert "lm_head" in targets and "model.embed_tokens" in targets and len(targets) == 2 + 2 * 4
    keys = {"lm_head.weight" if n == "lm_head" and not tied else "model.embed_tokens.weight" if n == "lm_head"
            else f"{n}.weight" for n in targets}
    for key, nrows, blocked in reads:
        if key in keys:
            assert blocked and nrows <= PACK_ROWS, (key, nrows)
    assert {k for k, _, _ in reads} >= keys
    for name, mod in targets.items():
        w = stored["model.embed_tokens.weight" if name == "lm_head" and tied else f"{name}.weight"]
        if isinstance(mod, QuantEmbedding):
            s = (w.float().abs().amax(dim=1) / 127).to(torch.bfloat16).float()
            s[s == 0] = 1  # an all-zero row (the padding token's): codes 0 under any scale
            assert torch.equal(mod.scales.float(), s)
            assert torch.equal(mod.codes, torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8))
        else:
            want_w, want_s = pack_matrix(w.float(), mod.qm)
            assert torch.equal(mod.qweight, want_w) and torch.equal(mod.scales, want_s), name


def test_dense_bytes_of_a_skeleton_equal_the_loaded_model(tmp_path):
    """:func:`dense_bytes` on a meta-device skeleton (nothing allocated) = the bytes the runtime's plan counts
    for the loaded, quantised model -- the number the memory plan can use before loading."""
    from transformers import AutoModelForCausalLM

    from expertcache.models.loader import load_config_checked, resolve_model_path
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.qlinear import dense_bytes

    path = resolve_model_path("coarse")
    config = load_config_checked(path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for mode in (None, "int8", "int4"):
        rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant_dense=mode))
        assert dense_bytes(skeleton, mode) == rt.plan.non_expert_bytes, mode
    assert dense_bytes(skeleton, "int4") < dense_bytes(skeleton, "int8") < dense_bytes(skeleton, None)


# -- CUDA (tinygemm int4; int8 as linear × scales): written to the same checks, run where a GPU is lent ------


@pytest.mark.gpu
@pytest.mark.parametrize("mode,n,k,group", SHAPES)
@pytest.mark.parametrize("m", [1, 5])
def test_cuda_fused_product_equals_x_times_dequantised_weight(mode, n, k, group, m):  # pragma: no cover - GPU only
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    qm = QuantMatrix(mode, kernel_for(mode, "cuda"), n, k, group, torch.bfloat16)
    assert qm.kernel == ("cuda" if mode == "int4" else "plain")
    w = _weights(n, k, 3)
    weight, scales = pack_matrix(w, qm)  # int4: packed on the device by _convert_weight_to_int4pack
    q, sc, z = quantize_codes(F.pad(w[None], (0, qm.k_pad - k), mode="replicate")[0], mode, group, torch.bfloat16)
    w_hat = _plain_dequant(q, sc, z, mode, group)[:, :k]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = qmm(x.cuda(), weight.cuda(), scales.cuda(), qm).cpu()
    ref = x.double() @ w_hat.double().T
    scale = (x.double().abs() @ w_hat.double().abs().T).max().item()
    assert got.shape == (m, n) and (got.double() - ref).abs().max().item() <= 2 ** -7 * scale


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cuda_quantised_runtime_matches_the_cpu_one(tiny_olmoe, mode):  # pragma: no cover - GPU only
    """The same quantised experts and dense weights on CUDA (tinygemm layout, packed on the device, its own
    sidecar) give the CPU runtime's logits within bf16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from expertcache.offload import OffloadConfig, OffloadedModel

    ids = torch.tensor([[3, 5, 7, 9, 11]])
    out = {}
    for device in ("cpu", "cuda"):
        rt = OffloadedModel.from_pretrained(tiny_olmoe, OffloadConfig(io="cached", quant=mode, quant_dense=mode,
                                                                      capacity=3), dtype=torch.bfloat16, device=device)
        assert rt.source.quant.kernel == kernel_for(mode, device)
        with torch.inference_mode():
            out[device] = rt.forward(ids).logits.float().cpu()
    rel = ((out["cuda"] - out["cpu"]).norm() / out["cpu"].norm()).item()
    assert rel < 0.02, rel


# -- int4 scale optimisers (quant_opt) and the q4 preset -----------------------------------------------------------


def _group_errors(w, q, s, z, group):
    n, k = w.shape
    wr = (q.float().view(n, k // group, group) - 8) * s.float()[..., None] + z.float()[..., None]
    return (wr - w.float().view(n, k // group, group))


@pytest.mark.parametrize("dist", ["normal", "student-t"])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_optimisers_never_lose_to_min_max_where_they_optimise(dist, group):
    """Against the plain min/max scales, per group and before the storage rounding of scale and zero (float32):
    ``lsq`` (least squares, monotone alternation from the min/max start among its candidates) has no group with a
    larger squared error; ``hqq`` (the l_p proximal zero, best iteration kept) none with a larger mean absolute
    error. After bf16 rounding both still lower the whole matrix's relative error. Codes stay in [0, 15] and are
    the rounding of W under the stored scale and zero."""
    from expertcache.offload.quant import quantize_codes

    g = torch.Generator().manual_seed(group)
    w = torch.randn(256, 512, generator=g) * 0.02
    if dist == "student-t":
        w = w * (torch.rand(256, 512, generator=g) ** -0.5)  # heavy tails: a few large weights per group
    errs = {}
    for opt in ("minmax", "hqq", "lsq"):
        q32, s32, z32 = quantize_codes(w, "int4", group, torch.float32, optimize=opt)
        assert int(q32.min()) >= 0 and int(q32.max()) <= 15
        e = _group_errors(w, q32, s32, z32, group)
        errs[opt] = (e.pow(2).sum(-1), e.abs().mean(-1))
        want_q = torch.round((w.view(256, -1, group) - z32[..., None]) / s32[..., None] + 8).clamp(0, 15)
        assert torch.equal(q32.view(256, -1, group).float(), want_q)
        q, s, z = quantize_codes(w, "int4", group, torch.bfloat16, optimize=opt)
        errs[opt + " bf16"] = _group_errors(w, q, s, z, group).norm() / w.norm()
    assert bool((errs["lsq"][0] <= errs["minmax"][0] * (1 + 1e-5) + 1e-12).all())
    assert bool((errs["hqq"][1] <= errs["minmax"][1] * (1 + 1e-5) + 1e-12).all())
    assert errs["lsq bf16"] < errs["minmax bf16"] and errs["hqq bf16"] < errs["minmax bf16"]


def test_an_unknown_optimiser_is_named():
    from expertcache.offload.quant import QuantLayout, quantize_codes

    with pytest.raises(ValueError, match="'gptq'"):
        quantize_codes(torch.zeros(4, 32), "int4", 32, torch.float32, optimize="gptq")
    with pytest.raises(ValueError, match="'gptq'"):
        QuantLayout("int4", 64, 32, 32, optimize="gptq")


def test_q4_preset_resolves_to_its_settings_and_keeps_what_is_given():
    from expertcache.offload import OffloadConfig
    from expertcache.offload.quant import QUANT_PRESETS, resolve_preset

    assert resolve_preset(OffloadConfig(quant="q4")) == OffloadConfig(quant="int4", quant_dense="int8", quant_opt="lsq")
    assert resolve_preset(OffloadConfig(quant="q4", quant_dense="int4")).quant_dense == "int4"
    assert resolve_preset(OffloadConfig(quant="q4", quant_opt="hqq")).quant_opt == "hqq"
    assert resolve_preset(OffloadConfig(quant="int4")) == OffloadConfig(quant="int4")
    assert set(QUANT_PRESETS) == {"q4", "q4m"}
    # "none" given beside a preset keeps the dense part unquantised (int4 experts alone), at the CLI too
    assert resolve_preset(OffloadConfig(quant="q4", quant_dense="none")) == OffloadConfig(quant="int4", quant_opt="lsq")
    from expertcache.cli.generate import offload_from_args
    from expertcache.cli.main import build_parser

    def dense(*argv):
        return resolve_preset(offload_from_args(build_parser().parse_args(["generate", *argv, "x"]),
                                                context=None)).quant_dense
    assert dense("--quant", "q4") == "int8" and dense("--quant", "q4", "--quant-dense", "none") is None
    assert dense("--quant", "q4m", "--quant-dense", "none") is None and dense("--quant", "int4") is None
    assert dense("--quant", "int4", "--quant-dense", "int8") == "int8" and dense("--quant-dense", "none") is None


def test_q4_runtime_sidecar_and_dense_cache_carry_the_optimiser(tiny_olmoe):
    """``quant='q4'``: int4 experts whose blobs are packed with least-squares scales (the sidecar's name and
    metadata say so: a min/max sidecar is another file), the dense part int8; the logits differ from plain
    ``int4 + dense int8`` (other scales) and stay near the unquantised model's."""
    from expertcache.offload.quant import pack_expert

    rt = _rt(tiny_olmoe, quant="q4", capacity=2)
    d = rt.describe()
    assert (d["quant"], d["quant_dense"], d["quant_opt"]) == ("int4", "int8", "lsq")
    assert "lsq" in rt.source.path.name and rt.source.quant.optimize == "lsq" and "lsq" in d["quant_kernel"]
    plain = _rt(tiny_olmoe, quant="int4", quant_dense="int8", capacity=2)
    assert plain.source.path != rt.source.path
    parts = rt.checkpoint.expert(rt.layers[0].layer_id, 0)
    from expertcache.offload.experts import expert_views
    from expertcache.offload.store import DiskTier, place_expert

    buf = torch.empty(parts.nbytes, dtype=torch.uint8)
    DiskTier("cached").fetch(parts, buf)
    blob = pack_expert(*expert_views(buf, parts, place_expert(parts, "cached"), parts.dtype), rt.source.quant)
    t = rt.source.parts(rt.layers[0].layer_id, 0)
    with open(t.reads[0].file, "rb") as f:
        f.seek(t.reads[0].offset)
        assert f.read(t.nbytes) == blob.numpy().tobytes()


def test_the_kernel_choice_is_stated_once_on_stderr_with_the_cpu(tiny_olmoe, capfd):
    """A quantised start says, in one stderr line, the CPU model, its ISA flags, ATen's capability and the kernel
    of each quantised part; ``describe()`` carries the same CPU description and the dense kernels."""
    from expertcache.offload.qlinear import int8_kernel
    from expertcache.offload.quant import cpu_description, expert_kernel

    rt = _rt(tiny_olmoe, quant="int4", quant_dense="int8", capacity=2)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "kernels on" in ln]
    c = cpu_description()
    assert len(lines) == 1 and c["cpu"] in lines[0] and f"ATen {c['aten_capability']}" in lines[0]
    ek = expert_kernel("int4")  # AVX2: q4x8 (tests/test_q4x8.py), or without numba FBGEMM's copies where C = N
    assert ("experts int4 _weight_int4pack_mm_for_cpu" in lines[0]) == (ek == "int4pack")
    assert ("experts int4 where every expert is resident (C = N) re-quantised per slot" in lines[0]) == (ek == "fbgemm")
    assert ("experts int4 q4x8 (numba, int8 activations per token" in lines[0]) == (ek == "q4x8")
    dk = int8_kernel()
    assert ("FBGEMM" in lines[0]) == (dk == "fbgemm") and ("dense part int8 q8x8 (numba" in lines[0]) == (dk == "q8x8")
    assert ("dense part int8 _weight_int8pack_mm" in lines[0]) == (dk == "int8pack")
    d = rt.describe()
    assert d["cpu"] == c and f"int8 {dk} ×" in d["dense_kernel"]
    _rt(tiny_olmoe, capacity=2)
    assert "kernels on" not in capfd.readouterr().err  # nothing quantised: no line


def test_generate_takes_the_q4_preset(capsys):
    """``expertcache generate --quant q4``: the run's row says what the preset stood for (int4 least-squares
    experts, the dense part int8) and the summary line names both parts' kernels; ``--group`` applies to it."""
    import json

    from expertcache.cli.main import main

    assert main(["generate", "--model", "granular", "--quant", "q4", "--group", "32", "--io", "cached",
                 "--max-new-tokens", "2", "--json", "The kernel"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    row = json.loads(err[-1])["config"]
    assert (row["quant"], row["quant_dense"], row["quant_opt"], row["group"]) == ("int4", "int8", "lsq", 32)
    assert "lsq" in row["quant_kernel"] and "int8" in row["dense_kernel"]
    assert sum("kernels on" in ln for ln in err) == 1

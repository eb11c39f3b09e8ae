"""Mixture of Lookup Experts: the table form gives the training form's logits; quantisers; readers; CLI plumbing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from expertcache.mole import quant as Q  # noqa: E402
from expertcache.mole.configs import tiny  # noqa: E402

from test_train import _write_corpus  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny dense, MoE and MoLE models trained a few steps on a synthetic corpus (same tokens each)."""
    from expertcache.mole.train import train_mole

    root = tmp_path_factory.mktemp("mole")
    _write_corpus(root / "corpus")
    torch.set_num_threads(1)
    out = {}
    for kind in ("dense", "moe", "mole"):
        cfg = tiny(kind, out=str(root / kind), data_dir=str(root / "corpus"))
        out[kind] = train_mole(cfg, progress=False)
    return root


def _ids(batch=3, t=12, seed=0, vocab=8192):
    return torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def table_fp32(runs):
    from expertcache.mole.export import export_table

    return export_table(runs / "mole" / "model", runs / "table-fp32", quant="none", dtype="float32")


def test_same_tokens_for_every_kind(runs):
    logs = {k: [json.loads(line) for line in open(runs / k / "log.jsonl")] for k in ("dense", "moe", "mole")}
    tokens = {k: [r["tokens"] for r in rows if "loss" in r] for k, rows in logs.items()}
    assert tokens["dense"] == tokens["moe"] == tokens["mole"] == [128 * s for s in range(1, 7)]
    data = {k: np.load(runs / k / "data" / "train.npy") for k in logs}
    assert np.array_equal(data["dense"], data["mole"]) and np.array_equal(data["moe"], data["mole"])
    # held-out loss well below uniform over the 8192-token vocabulary (ln 8192 = 9.01): measured 6.93 (mole),
    # 6.96 (dense), 6.99 (moe) after these 6 steps; a model that does not learn stays at >= 9.0
    assert all(logs[k][-1]["heldout_loss"] < math.log(8192) - 1.5 for k in logs), [logs[k][-1] for k in logs]
    assert all(logs[k][-1]["heldout_loss"] < logs[k][0]["loss"] - 1.5 for k in logs)  # and below the first step's
    assert "aux_loss" in logs["moe"][0] and logs["moe"][0]["aux_loss"] > 0 and logs["mole"][0]["aux_loss"] == 0


def test_save_and_load_roundtrip(runs):
    from transformers import AutoModelForCausalLM

    from expertcache.mole.modeling import MoleForCausalLM

    a = MoleForCausalLM.from_pretrained(runs / "mole" / "model").eval()
    b = AutoModelForCausalLM.from_pretrained(runs / "mole" / "model").eval()
    assert type(b) is MoleForCausalLM and a.config.num_experts == 4
    x = _ids()
    assert torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)


@pytest.mark.parametrize("read_mode", ["mmap", "pread", "flash"])
def test_table_logits_equal_training_form(runs, table_fp32, read_mode):
    from safetensors import safe_open

    from expertcache.mole.modeling import MoleForCausalLM, load_table_model

    ref = MoleForCausalLM.from_pretrained(runs / "mole" / "model", dtype=torch.float32).eval()
    tab = load_table_model(table_fp32, read_mode)
    assert not [n for n, _ in tab.named_parameters() if ".experts." in n or "expert_norm" in n]
    with safe_open(str(table_fp32 / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if ".experts." in k or "expert_norm" in k]  # never even on disk there
    x = _ids(batch=3, t=12)
    with torch.no_grad():
        torch.testing.assert_close(tab(input_ids=x).logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        # prefill + cached decode at batch 3 equals the full forward
        out = tab(input_ids=x[:, :8], use_cache=True)
        step = tab(input_ids=x[:, 8:9], past_key_values=out.past_key_values, use_cache=True)
        torch.testing.assert_close(step.logits[:, 0], ref(input_ids=x[:, :9]).logits[:, 8], rtol=1e-5, atol=1e-5)
    s = tab.model.table.stats
    r = tab.model.table.spec.record_bytes
    assert s.bytes == s.reads * r and s.reads <= s.tokens == 3 * 12 + 3 * 8 + 3
    if read_mode == "flash":
        assert s.device_bytes % 4096 == 0 and s.device_bytes >= s.reads * 4096


def test_quantised_tables_are_close_and_smaller(runs, table_fp32):
    from expertcache.mole.modeling import load_table_model
    from expertcache.mole.export import export_table

    ref = load_table_model(table_fp32)
    x = _ids(batch=2, t=16, seed=1)
    base = ref(input_ids=x).logits
    sizes = {}
    for quant, tol in (("int8", 0.02), ("nf4", 0.2)):
        d = export_table(runs / "mole" / "model", runs / f"table-{quant}", quant=quant)
        m = load_table_model(d)
        assert (m(input_ids=x).logits - base).abs().max().item() < tol
        sizes[quant] = m.model.table.spec.record_bytes
    fp16 = load_table_model(export_table(runs / "mole" / "model", runs / "table-fp16", quant="none"))
    assert (fp16(input_ids=x).logits - base).abs().max().item() < 1e-3
    m = 2 * 4 * 32  # L * N * D values per token
    assert fp16.model.table.spec.record_bytes == 2 * m
    assert sizes == {"int8": m + m // 64 * 2, "nf4": m // 2 + m // 64 * 2}


def test_export_refuses_non_mole_and_replaces_atomically(runs, table_fp32, tmp_path):
    from expertcache.mole.export import export_table

    with pytest.raises(ValueError, match="not a training-form MoLE"):
        export_table(runs / "dense" / "model", tmp_path / "t")
    with pytest.raises(ValueError, match="not a training-form MoLE"):
        export_table(table_fp32, tmp_path / "t")
    out = export_table(runs / "mole" / "model", tmp_path / "t", quant="nf4")
    out = export_table(runs / "mole" / "model", tmp_path / "t", quant="int8")
    assert json.loads((out / "config.json").read_text())["lookup_table"]["quant"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_nf4_and_int8_roundtrip():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 3, 200)).astype(np.float32) * rng.uniform(0.01, 3, size=(7, 3, 1)).astype(np.float32)
    x[0, 0] = 0  # an all-zero row stays zero
    for quant, max_err in (("int8", 0.5 / 127 + 1e-3), ("nf4", 0.5 * 0.3208 + 1e-3)):  # half the widest level gap
        codes, absmax = Q.quantize(x, quant)
        assert absmax.dtype == np.float16 and absmax.shape == (7, 3, 4)
        assert codes.shape == (7, 3, Q.code_bytes(quant, 200))
        y = Q.dequantize(codes, absmax, quant, 200)
        scale = np.repeat(absmax.astype(np.float32), 64, axis=-1)[..., :200]
        assert np.all(np.abs(y - x) <= max_err * scale + 1e-6)
        assert np.all(y[0, 0] == 0)
    levels = np.tile(Q.NF4_LEVELS, 4)[None]  # the 16 levels are reproduced exactly
    c, a = Q.quantize(levels, "nf4")
    np.testing.assert_array_equal(Q.dequantize(c, a, "nf4", 64), levels)


# QLoRA's NF4 table as published (Dettmers et al. 2023, Appendix E; bitsandbytes' NF4 code book)
QLORA_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]


def test_nf4_levels_are_qloras():
    """The code book is QLoRA's, code i decodes to level i, and quantisation picks the nearest level (midpoints)."""
    np.testing.assert_array_equal(Q.NF4_LEVELS, np.array(QLORA_NF4, dtype=np.float32))
    # decode every code: byte (hi << 4 | lo) holds two values, low nibble first; block absmax 1.0
    codes = np.array([[i | (i << 4) for i in range(16)] * 2], dtype=np.uint8)  # 64 values: 0,0,1,1,...,15,15 x2
    got = Q.dequantize(codes, np.ones((1, 1), dtype=np.float16), "nf4", 64)[0]
    np.testing.assert_array_equal(got, np.repeat(np.array(QLORA_NF4, dtype=np.float32), 2).tolist() * 2)
    # just below / above each midpoint goes to the lower / upper level (absmax pinned to 1 by a 1.0 entry)
    mids = (np.array(QLORA_NF4[1:]) + np.array(QLORA_NF4[:-1])) / 2
    x = np.concatenate([[1.0], mids - 1e-4, mids + 1e-4, [-1.0, 0.0, 0.0, 0.0]]).astype(np.float32)[None]
    assert x.shape == (1, 35)
    y = Q.dequantize(*Q.quantize(x, "nf4"), "nf4", 35)[0]
    np.testing.assert_array_equal(y[1:16], np.array(QLORA_NF4[:-1], dtype=np.float32))
    np.testing.assert_array_equal(y[16:31], np.array(QLORA_NF4[1:], dtype=np.float32))


def test_batched_lru_matches_simulator_at_batch_one():
    from expertcache.mole.bench import lru_batched_misses
    from expertcache.sim import replay

    rng = np.random.default_rng(0)
    ids_TLK = np.stack([np.stack([rng.choice(12, 3, replace=False) for _ in range(2)]) for _ in range(300)])
    for cap in (3, 6, 9):
        ours = lru_batched_misses(ids_TLK[None], 12, cap)
        sim = replay(ids_TLK, 12, cap, eviction="lru")
        assert ours.tolist() == [s.misses for s in sim.per_layer]
    two = lru_batched_misses(np.stack([ids_TLK, ids_TLK[::-1]]), 12, 3)
    assert (two >= lru_batched_misses(ids_TLK[None], 12, 3)).all()


def test_cli_export_generate_eval(runs, tmp_path, capsys):
    from expertcache.cli.main import main

    table = tmp_path / "table"
    assert main(["mole", "export", str(runs / "mole" / "model"), "--out", str(table), "--quant", "nf4"]) == 0
    assert "nf4 table" in capsys.readouterr().out
    assert main(["mole", "generate", str(table), "the kernel", "--max-new-tokens", "5", "--read-mode", "flash"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("the kernel") and "table reads" in cap.err
    rows = tmp_path / "rows.jsonl"
    for d in (runs / "dense" / "model", runs / "moe" / "model", table):
        assert main(["mole", "eval", str(d), "--data-dir", str(runs / "corpus"), "--ppl-tokens", "600",
                     "--prompt-tokens", "8", "--new-tokens", "3", "--moe-tokens", "32", "--out", str(rows)]) == 0
    r = {x["kind"]: x for x in map(json.loads, open(rows))}
    assert r["dense"]["params_offloaded"] == 0 and r["dense"]["bytes_per_token"]["b1"] == 0
    assert r["moe"]["moe_capacity"] == 2 and r["moe"]["bytes_per_token"]["b1"] > 0
    t = r["mole-table"]
    assert t["bytes_per_token"]["b1"] == t["table"]["record_bytes"] and t["params_offloaded"] == 8192 * 2 * 4 * 32
    assert all(x["heldout_ppl"] > 1 for x in r.values())
    assert main(["mole", "export", str(runs / "dense" / "model"), "--out", str(tmp_path / "x")]) == 2

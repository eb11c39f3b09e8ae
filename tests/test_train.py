"""Training pipeline: held-out split rule, data-dir resolution, CLI flags, determinism and exact resume."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from expertcache.train.configs import MODEL_SPECS, TrainConfig  # noqa: E402
from expertcache.train.data import is_heldout, load_documents, resolve_data_dir, split_documents  # noqa: E402

WORDS = ("the kernel module loads a driver for each device and the python interpreter reads a file then "
         "returns a list of values from the function call while perl prints text to the console").split()


def _write_corpus(path, n_docs=60, seed=0):
    """Synthetic corpus folder: two JSONL files of word-salad documents with varied sources."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    sources = []
    for f in ("a.jsonl", "b.jsonl"):
        with open(path / f, "w") as fh:
            for i in range(n_docs // 2):
                src = f"{f[0]}-pkg:doc/{i}.rst"
                sources.append(src)
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 200)))
                fh.write(json.dumps({"source": src, "text": text}) + "\n")
    return sources


def test_heldout_rule_on_synthetic_jsonl(tmp_path):
    sources = _write_corpus(tmp_path / "corpus")
    docs = load_documents(tmp_path / "corpus")
    train, heldout = split_documents(docs)
    expected = {s for s in sources if hashlib.sha256(s.encode()).hexdigest()[0] == "0"}
    assert expected, "fixture should contain at least one held-out source"
    assert {d["source"] for d in heldout} == expected
    assert {d["source"] for d in train} == set(sources) - expected
    assert is_heldout("a-pkg:doc/0.rst") == (hashlib.sha256(b"a-pkg:doc/0.rst").hexdigest()[0] == "0")


def test_bad_rows_and_missing_data_dir_are_clear(tmp_path, monkeypatch):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text('{"text": "no source"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:1"):
        load_documents(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="EXPERTCACHE_DATA"):
        resolve_data_dir(tmp_path / "nowhere")
    _write_corpus(tmp_path / "shared" / "corpus-debian-docs", n_docs=4)
    monkeypatch.setenv("EXPERTCACHE_DATA", str(tmp_path / "shared"))
    assert resolve_data_dir() == tmp_path / "shared" / "corpus-debian-docs"


def test_cli_flags_follow_train_config():
    import argparse

    from expertcache.cli import train as cli_train

    parser = argparse.ArgumentParser()
    cli_train.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--model", "coarse", "--steps", "7"])
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    assert (cfg.model, cfg.steps, cfg.lr) == ("coarse", 7, TrainConfig().lr)
    with pytest.raises(ValueError, match="unknown model"):
        TrainConfig(model="huge")
    assert {"granular", "coarse"} <= set(MODEL_SPECS)


def test_granular_256_is_a_model_llama_cpp_can_quantise():
    """llama.cpp's K-quants take rows of whole 256-weight super-blocks and llama.cpp 0.3.36 loads no tied lm_head:
    the comparison preset has every matrix row a multiple of 256 and its own lm_head (granular has D = 144, tied)."""
    from expertcache.train.configs import build_hf_config, build_model

    spec = MODEL_SPECS["granular-256"]
    cfg = build_hf_config(spec, 8192, 256, 0, 0, 1)
    assert cfg.hidden_size % 256 == 0 and cfg.intermediate_size % 256 == 0
    assert cfg.hidden_size // cfg.num_attention_heads == 64 and cfg.model_type == "olmoe"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers) == (16, 4, 4)
    assert cfg.tie_word_embeddings is False
    model = build_model(cfg)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    for name, p in model.named_parameters():  # every matrix: rows of whole 256-blocks (the router: [E, D])
        if p.dim() >= 2:
            assert p.shape[-1] % 256 == 0, (name, tuple(p.shape))
    # 2 × V × D (embedding, lm_head) + L × (4 D² attention + E × 3 D F experts + E × D router + 2 D q/k norms +
    # 2 D layer norms) + D final norm
    d, f, e, L, v = 256, 256, 16, 4, 8192
    assert sum(p.numel() for p in model.parameters()) == 2 * v * d + L * (4 * d * d + e * 3 * d * f + e * d + 4 * d) + d
    assert MODEL_SPECS["granular"].tied  # the shipped ones stay tied


def _tiny_cfg(tmp_path, name):
    return TrainConfig(model="tiny", out=str(tmp_path / name), data_dir=str(tmp_path / "corpus"), vocab_size=300,
                       seq_len=32, batch_size=4, steps=12, lr=1e-2, warmup_steps=2, log_every=1, eval_every=6,
                       ckpt_every=4, eval_tokens=512)


def _losses(summary_dir):
    rows = [json.loads(line) for line in open(summary_dir / "log.jsonl")]
    return [(r["step"], r.get("loss"), r.get("aux_loss"), r.get("heldout_loss")) for r in rows]


def test_tiny_training_is_deterministic_and_resumes_exactly(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.train.loop import train

    _write_corpus(tmp_path / "corpus")
    train(_tiny_cfg(tmp_path, "a"), progress=False)
    train(_tiny_cfg(tmp_path, "b"), progress=False)
    train(_tiny_cfg(tmp_path, "c"), progress=False, stop_at=5)  # "interrupted" after step 5 ...
    assert json.loads((tmp_path / "c" / "model" / "train_summary.json").read_text())["steps_done"] <= 5
    train(_tiny_cfg(tmp_path, "c"), progress=False)  # ... and resumed from its checkpoint
    a, b, c = (_losses(tmp_path / n) for n in "abc")
    assert a == b, "same seed must give identical losses"
    assert a == c, "resumed run must match the uninterrupted one"
    train_losses = [r[1] for r in a if r[1] is not None]
    assert len(train_losses) == 12 and train_losses[-1] < train_losses[0]
    wa, wc = load_file(tmp_path / "a" / "model" / "model.safetensors"), load_file(tmp_path / "c" / "model" / "model.safetensors")
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)

    model_dir = tmp_path / "a" / "model"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "loss_curve.png",
              "train_log.jsonl", "train_summary.json"):
        assert (model_dir / f).is_file(), f
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("the kernel module", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(input_ids=ids).logits.float()).all()
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"


def test_resume_refuses_a_different_config(tmp_path):
    from expertcache.train.loop import train

    _write_corpus(tmp_path / "corpus")
    cfg = _tiny_cfg(tmp_path, "r")
    train(dataclasses.replace(cfg, steps=4), progress=False, stop_at=2)
    with pytest.raises(ValueError, match="different config"):
        train(dataclasses.replace(cfg, steps=4, lr=5e-3), progress=False)


def test_card_for_a_tiny_model(tmp_path):
    import transformers

    from expertcache.train.card import write_card
    from expertcache.train.loop import train

    _write_corpus(tmp_path / "corpus")
    train(dataclasses.replace(_tiny_cfg(tmp_path, "m"), steps=3), progress=False)
    card = write_card(tmp_path / "m" / "model", data_dir=str(tmp_path / "corpus"), command="expertcache train --card-only X")
    r = json.loads((card.parent / "card.json").read_text())
    h = r["heldout"]
    assert h["tokens_scored"] > 0 and h["ppl"] > 1 and h["unigram_ppl_train_freqs"] > 1
    assert r["num_experts"] == MODEL_SPECS["tiny"].experts and len(r["load_balance"]) == MODEL_SPECS["tiny"].layers
    assert r["transformers"] == transformers.__version__  # the card records the version it was made with
    assert all(0 <= b["min_frac"] <= 1 / r["num_experts"] <= b["max_frac"] <= 1 for b in r["load_balance"])
    rates = {(c["capacity_label"], c["eviction"]): c["miss_rate"] for c in r["cache"]}
    for size in ("N/2", "N/4"):
        assert rates[(size, "belady")] <= rates[(size, "lru")]
    text = card.read_text()
    assert "expertcache train --card-only X" in text and "| held-out split (model) |" in text


@pytest.mark.parametrize("name", ["granular", "coarse"])
@pytest.mark.parametrize("installed", [None, "5.24.0", "6.0.0"])
def test_model_card_renders_from_its_card_json(name, installed, monkeypatch):
    """The shipped MODEL_CARD.md is exactly what render_card makes of the shipped card.json (template + rows),
    whichever transformers is installed: the card names the version it was made with (card.json, as the model's
    config.json records it), so a newer transformers (the unconstrained set-up line) changes no number."""
    import transformers

    from expertcache.assets import shipped_model_dir
    from expertcache.train.card import render_card

    if installed:
        monkeypatch.setattr(transformers, "__version__", installed)
    d = shipped_model_dir(name)
    r = json.loads((d / "card.json").read_text())
    assert r["transformers"] == json.loads((d / "config.json").read_text())["transformers_version"]
    assert render_card(r, r["command"]) == (d / "MODEL_CARD.md").read_text()


def test_a_card_of_a_model_built_by_command_says_so():
    """granular-256 (not shipped: ~36 MB): its card names its preset, its untied lm_head and its folder, never
    "shipped" or ``shipped_model_dir``; ``--ship`` of it is refused before training."""
    import subprocess
    import sys

    from expertcache.assets import shipped_model_dir
    from expertcache.train.card import render_card

    r = json.loads((shipped_model_dir("granular") / "card.json").read_text())
    r["tied"], r["model_dir"] = False, "/data/q256/model"
    r["train"]["config"]["model"] = "granular-256"
    text = render_card(r, "expertcache train --card-only /data/q256/model")
    assert "`granular-256` preset, not shipped" in text and "untied embedding and lm_head" in text
    assert "shipped_model_dir" not in text and "path = '/data/q256/model'" in text
    assert "shipped model" not in text and "for shipping" not in text
    p = subprocess.run([sys.executable, "-m", "expertcache.cli.main", "train", "--model", "granular-256", "--ship",
                        "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--ship" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]

"""The two models shipped inside the package load offline, fit the size budget and have the promised shape."""

from __future__ import annotations

import pytest

from expertcache import assets
from expertcache.assets import SHIPPED_MODELS, shipped_model_dir

MAX_BYTES = 16_000_000


def test_shipped_model_dir_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="granular, coarse"):
        shipped_model_dir("nope")
    monkeypatch.setattr(assets, "MODELS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="expertcache train --model coarse"):
        shipped_model_dir("coarse")


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_shipped_model(name):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from expertcache.train.configs import MODEL_SPECS, count_params

    try:
        path = shipped_model_dir(name)
    except FileNotFoundError as exc:
        pytest.skip(f"shipped model {name!r} not trained/installed yet: {exc}")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size <= MAX_BYTES, f"{path} is {size} bytes"
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    spec = MODEL_SPECS[name]
    cfg = model.config
    assert type(model).__name__ == {"olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM"}[spec.arch]
    assert (getattr(cfg, "num_experts", None) or cfg.num_local_experts) == spec.experts
    assert cfg.num_experts_per_tok == spec.top_k
    assert cfg.num_hidden_layers == spec.layers and cfg.hidden_size == spec.hidden
    total, experts = count_params(model)
    assert experts / total >= 0.75
    ids = tok("The kernel module", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits.float()).all()

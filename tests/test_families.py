"""One registration per model family (``models/adapters.py: FAMILIES``), pinned.

- every registered family declares everything the code reads per family, and its disk layout names exactly the
  tensors transformers' ``save_pretrained`` writes for its tiny config (checked against the safetensors headers,
  not against the checkpoint reader), as does ``--make-model``'s writer;
- no module outside the registry names a model type (the AST of every source file);
- a family registered once, from outside the package (a copy of OLMoE under a new ``model_type`` with its own
  on-disk key names), loads, routes and offloads: the patch's decisions and logits equal the shipped OLMoE
  family's on the same weights, and the offloaded runtime reads a checkpoint written in its declared layout and
  gives the stock transformers logits.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from expertcache.models import load_model, patch_model
from expertcache.models.adapters import FAMILIES, DiskLayout, Family, family_for, find_moe_layers, register_family
from expertcache.models.tiny import TINY_ARCHS, save_tiny, tiny_config
from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.offload.checkpoint import read_header
from expertcache.offload.writer import write_safetensors
from expertcache.routing import RoutingConfig
from conftest import decode_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

SRC = Path(__file__).resolve().parents[1] / "src" / "expertcache"
REGISTRY = "models/adapters.py"
#: model-type names outside the registry that are not a family branch: (file, name) → why
ALLOWED = {
    ("train/configs.py", "olmoe"): "training builds its own OLMoE / Mixtral layouts (train sits beside models)",
    ("train/configs.py", "mixtral"): "the same",
    ("mole/report.py", "mixtral"): "002's comparison kinds of a model folder (dense, MoE, MoLE)",
    ("mole/bench.py", "mixtral"): "002's MoE baseline is a Mixtral-layout model",
}


def _n_experts(cfg) -> int:
    return next(getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                if getattr(cfg, k, None))


# ---------------------------------------------------------------------------------------------
# every family declares everything; the declaration is what transformers writes


def test_every_family_declares_its_layout_and_tiny_configs():
    assert set(TINY_ARCHS) == {a for f in FAMILIES.values() for a in f.tiny}
    for name, f in FAMILIES.items():
        assert f.model_type == name
        for field in dataclasses.fields(Family):
            assert getattr(f, field.name) is not None, (name, field.name)
        assert isinstance(f.disk, DiskLayout)
        assert next(iter(f.tiny)) == name, f"{name}: the first tiny config is named after the model type"
        for arch in f.tiny:
            assert family_for(tiny_config(arch)) is f


def test_a_family_is_refused_without_a_disk_layout_or_a_tiny_config():
    olmoe = FAMILIES["olmoe"]
    with pytest.raises(TypeError, match="disk"):
        dataclasses.replace(olmoe, disk=None)
    with pytest.raises(ValueError, match="must start with a config named 'olmoe'"):
        dataclasses.replace(olmoe, tiny={})
    with pytest.raises(ValueError, match="registered already"):
        register_family(olmoe)
    with pytest.raises(ValueError, match="fused must be"):
        DiskLayout(fused="gpt_oss")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_disk_layout_names_what_save_pretrained_writes(arch, tmp_path):
    """Every tensor of the tiny checkpoint is either a routed expert named by the family's layout (per expert, for
    every MoE layer and expert, or the fused tensors) or the key ``DiskLayout.disk_keys`` gives for exactly one
    in-memory tensor; nothing is left over, and every rename the layout declares is used."""
    path = save_tiny(arch, tmp_path / arch, seed=0)
    on_disk = set(read_header(path / "model.safetensors"))
    family = FAMILIES[tiny_config(arch).model_type]
    layout = family.disk
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(tiny_config(arch))
    layers = find_moe_layers(model, family)
    named: set[str] = set()
    for m in layers:
        per_expert = [layout.expert_keys(m.layer_id, e) for e in range(m.num_experts)]
        gu, down = layout.fused_keys(m.layer_id)
        fused = [gu, down] + ([gu + "_bias", down + "_bias"] if layout.fused == "interleaved" else [])
        if per_expert[0] is not None and per_expert[0][0] in on_disk:
            named |= {k for keys in per_expert for k in keys}
        else:
            named |= set(fused)
    assert named <= on_disk, sorted(named - on_disk)[:3]
    renamed = 0
    for name in model.state_dict():
        if ".experts." in name or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        hits = [k for k in layout.disk_keys(name) if k in on_disk]
        assert len(hits) == 1, (name, hits)
        named.add(hits[0])
        renamed += hits[0] != name
    assert named == on_disk, sorted(on_disk - named)[:3]
    assert (renamed > 0) == bool(layout.renames)
    # --make-model's writer names and shapes the tensors as transformers does (it follows the same declaration)
    from expertcache.offload.make_model import _disk_entries

    written = {k: s for name, t in model.state_dict().items()
               for k, s in _disk_entries(family.model_type, name, tuple(t.shape))}
    assert written == {k: t.shape for k, t in read_header(path / "model.safetensors").items()}


def test_no_model_type_is_named_outside_the_registry():
    """A string literal equal to a registered model type (or tiny config name) appears only in the registry, as a
    config's ``model_type=`` field, or in ``ALLOWED``: nothing else branches on a family's name."""
    names = set(FAMILIES) | set(TINY_ARCHS)
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel == REGISTRY:
            continue
        tree = ast.parse(path.read_text(), rel)
        declared = {id(kw.value) for node in ast.walk(tree) if isinstance(node, ast.Call) for kw in node.keywords
                    if kw.arg == "model_type"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in declared:
                found.add((rel, node.value, node.lineno))
    bad = sorted(f for f in found if f[:2] not in ALLOWED)
    assert not bad, f"model types named outside {REGISTRY} (read FAMILIES instead): {bad}"
    assert {f[:2] for f in found} == set(ALLOWED), "ALLOWED lists a (file, name) that no longer occurs"


# ---------------------------------------------------------------------------------------------
# a family registered once runs everywhere


TOY = "toy_moe"
#: the toy family's own checkpoint names: experts under ``moe`` as w_gate/w_up/w_down, the router renamed
TOY_LAYOUT = DiskLayout("moe", ("w_gate", "w_up", "w_down"), renames=((".mlp.gate.", ".moe.router."),))


@pytest.fixture(scope="module")
def toy_family():
    """``toy_moe``: OLMoE's classes under a new model type (registered with transformers as a user's model would
    be), declared once with ``register_family``; removed from ``FAMILIES`` afterwards."""
    from transformers import AutoConfig, AutoModelForCausalLM, OlmoeConfig, OlmoeForCausalLM

    class ToyMoeConfig(OlmoeConfig):
        model_type = TOY

    class ToyMoeForCausalLM(OlmoeForCausalLM):
        config_class = ToyMoeConfig

    AutoConfig.register(TOY, ToyMoeConfig, exist_ok=True)
    AutoModelForCausalLM.register(ToyMoeConfig, ToyMoeForCausalLM, exist_ok=True)
    olmoe = FAMILIES["olmoe"]
    family = register_family(dataclasses.replace(olmoe, model_type=TOY, disk=TOY_LAYOUT,
                                                 tiny={TOY: dict(olmoe.tiny["olmoe"], num_experts=6)}))
    yield family
    del FAMILIES[TOY]


def _as_olmoe(path: Path, out: Path) -> Path:
    """The same weights as a shipped OLMoE checkpoint (config.json's model type and class renamed)."""
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, model_type="olmoe", architectures=["OlmoeForCausalLM"])))
    return out


def _in_declared_layout(path: Path, out: Path, layout: DiskLayout) -> Path:
    """``path`` rewritten with its fused experts split per expert and its router renamed as ``layout`` declares
    (gate rows first in ``gate_up_proj`` [E, 2F, D], ``down_proj`` [E, D, F])."""
    shutil.copytree(path, out)
    src = read_header(path / "model.safetensors")
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    entries = []
    for key, t in tensors.items():
        if key.endswith(".mlp.experts.gate_up_proj") or key.endswith(".mlp.experts.down_proj"):
            layer_id = int(key.split(".")[2])
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                gate_k, up_k, down_k = layout.expert_keys(layer_id, e)
                if key.endswith("gate_up_proj"):
                    entries += [(gate_k, t[e, :f].clone()), (up_k, t[e, f:].clone())]
                else:
                    entries.append((down_k, t[e].clone()))
        else:
            entries.append((layout.disk_keys(key)[-1], t))
    assert len({k for k, _ in entries}) == len(entries) and len(src) < len(entries)
    write_safetensors(out / "model.safetensors", [(k, t.dtype, tuple(t.shape), (lambda t=t: t)) for k, t in entries])
    return out


def test_a_family_registered_once_loads_routes_and_offloads(toy_family, tmp_path):
    from expertcache.models.tiny import build_tiny

    assert build_tiny(TOY).config.model_type == TOY and TOY not in TINY_ARCHS  # tiny.py reads the live registry
    path = save_tiny(TOY, tmp_path / TOY, seed=5)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(7))
    toy = load_model(path)
    assert family_for(toy) is toy_family and [m.num_experts for m in find_moe_layers(toy, toy_family)] == [6, 6]
    with torch.no_grad():
        stock = toy(ids).logits
    # the patch: the same decisions and logits as the shipped OLMoE family on the same weights
    olmoe = load_model(_as_olmoe(path, tmp_path / "as-olmoe"))
    rc = RoutingConfig(policy="cache-prior", lam=0.5, top_j=1)
    runs = []
    for model in (toy, olmoe):
        with patch_model(model, rc, capacity=2, record=True) as patch, torch.no_grad():
            logits = model(ids).logits
            runs.append((logits, [s.misses for s in patch.stats().per_layer], patch.trace().ids_TLK))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert np.array_equal(runs[0][2], runs[1][2])
    assert not torch.equal(runs[0][0], stock)  # λ = 0.5 at C = 2 changed some selection
    # the offloaded runtime: transformers' fused tensors, and the toy's own per-expert names
    declared = _in_declared_layout(path, tmp_path / "declared", TOY_LAYOUT)
    header = read_header(declared / "model.safetensors")
    assert "model.layers.0.moe.router.weight" in header and "model.layers.0.moe.experts.5.w_up.weight" in header
    assert not any(k.endswith("_proj") or ".mlp." in k for k in header)  # only the declared names
    for folder in (path, declared):
        rt = OffloadedModel.from_pretrained(folder, OffloadConfig(tier="disk", io="cached", capacity=2, readers=0),
                                            dtype=torch.float32)
        assert rt.checkpoint.expert(0, 5).layout == "linear"
        torch.testing.assert_close(decode_logits(rt, ids, 3), stock, rtol=1e-5, atol=1e-5)

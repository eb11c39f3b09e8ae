"""The package's layering, pinned: no module imports (at top level or inside a function) from its own layer's
other packages or from a layer above it. docs/ARCHITECTURE.md describes the layers."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "expertcache"

#: bottom to top; a package may import only from packages in lower layers (and from itself)
LAYERS = [
    {"jsonsafe"},  # the one JSON reader: imports nothing of expertcache
    {"outputs"},  # the output rule (paths, marks, temporary names): reads marks with jsonsafe
    {"__init__", "compiled", "results", "assets", "inputs", "device", "registries"},  # the package root and shared utilities
    {"routing"},  # policies: logits + residency -> ids (kernels)
    {"cache"},  # per-layer caches: ids -> hits, misses, evictions (kernels)
    {"trace", "sim"},  # recorded routing; open-loop simulation and replay
    {"models", "train", "analysis"},  # the HF patch; training; trace analysis
    {"offload"},  # the offloaded runtime (uses models' adapters, train's checkpoints)
    {"eval", "mole"},  # tasks, sweeps and budget-targeted evaluation; MoLE
    {"melinoe", "serve"},  # 004's fine-tuning/predictor (uses models, eval, train); the server and live view
    {"integrations", "cli"},  # third-party harnesses (lm-eval); the command line
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

#: the one upward import, function-level and named exactly: the config-vs-weights check of the model loader
#: reads safetensors headers with the offload checkpoint's parser (a leaf module, pinned below)
EXCEPTIONS = {"models/loader.py": {"expertcache.offload.checkpoint"}}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def _imported_packages(path: Path) -> set[str]:
    allowed = EXCEPTIONS.get(str(path.relative_to(ROOT)), set())
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "expertcache" else [f"expertcache.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name in allowed:
                continue
            parts = name.split(".")
            if parts[0] == "expertcache" and len(parts) > 1:
                out.add(parts[1] if parts[1] in LAYER_OF else "__init__")
    return out


def test_every_package_has_a_layer():
    pkgs = {_package(p) for p in ROOT.rglob("*.py")}
    assert pkgs <= set(LAYER_OF), f"add {sorted(pkgs - set(LAYER_OF))} to LAYERS"


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_from_a_layer_above_or_beside(path):
    pkg = _package(path)
    bad = sorted(t for t in _imported_packages(path) - {pkg} if LAYER_OF[t] >= LAYER_OF[pkg] and t != "__init__")
    assert not bad, f"{path.relative_to(ROOT)} (layer {LAYER_OF[pkg]}: {pkg}) imports from {bad}"


def test_the_exceptions_are_leaves():
    """An allowed upward import must not pull its layer in: the module imports nothing of expertcache but the
    bottom layer (the JSON reader, itself a leaf)."""
    for targets in EXCEPTIONS.values():
        for name in targets:
            path = ROOT.joinpath(*name.split(".")[1:]).with_suffix(".py")
            assert path.exists(), name
            assert _imported_packages(path) <= LAYERS[0], f"{name} imports from expertcache: no longer a leaf"


def test_the_layers_are_used():
    """Every package of LAYERS exists (a renamed package must be renamed here, not silently dropped)."""
    pkgs = {_package(p) for p in ROOT.rglob("*.py")}
    assert set(LAYER_OF) - {"__init__"} <= pkgs, sorted(set(LAYER_OF) - pkgs)

"""The package's layering, pinned: no module imports (at top level or inside a function) from its own layer's
other packages or from a layer above it. docs/ARCHITECTURE.md describes the layers."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "expertcache"

#: bottom to top; a package may import only from packages in lower layers (and from itself)
LAYERS = [
    {"__init__", "compiled", "results", "assets"},  # the package root and shared utilities
    {"routing"},  # policies: logits + residency -> ids (kernels)
    {"cache"},  # per-layer caches: ids -> hits, misses, evictions (kernels)
    {"trace", "sim"},  # recorded routing; open-loop simulation and replay
    {"models", "train", "analysis"},  # the HF patch; training; trace analysis
    {"offload"},  # the offloaded runtime (uses models' adapters, train's checkpoints)
    {"eval", "mole"},  # tasks and sweeps; MoLE
    {"cli"},
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def _imported_packages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "expertcache" else [f"expertcache.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
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

"""Rooms one can hold in one's head (issue 46), pinned for the packages split so far (``offload``, ``routing``):
no file over 600 lines, no class over 500 lines counting the project classes it inherits from, and no class that
inherits from another project class (composition: a part holds the parts it calls; no mixin that brings state).
The other packages join ``PACKAGES`` as they are split (serve/: issue 46's other half; models/patch.py's MoEPatch
still inherits its stream and recording mixins)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "expertcache"
PACKAGES = ("offload", "routing")
MAX_FILE, MAX_CLASS = 600, 500


def _classes() -> dict[str, tuple[Path, int, list[str]]]:
    """Every class under src/expertcache: name -> (file, lines, base names)."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        for c in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(c, ast.ClassDef):
                out.setdefault(c.name, (p, c.end_lineno - c.lineno + 1, [ast.unparse(b).split(".")[-1]
                                                                        for b in c.bases]))
    return out


def _files():
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_over_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_FILE, f"{path.relative_to(ROOT)}: {n} lines"


def test_no_class_over_500_lines_with_its_project_bases_and_no_mixin():
    classes = _classes()

    def total(name: str, seen: tuple = ()) -> int:
        if name not in classes or name in seen:
            return 0
        _, n, bases = classes[name]
        return n + sum(total(b, seen + (name,)) for b in bases)

    big, mixins = [], []
    for name, (path, _, bases) in classes.items():
        if path.relative_to(ROOT).parts[0] not in PACKAGES:
            continue
        if total(name) > MAX_CLASS:
            big.append(f"{name} ({path.relative_to(ROOT)}): {total(name)} lines")
        project = [b for b in bases if b in classes and not b.endswith(("Error", "Exception"))]
        mixins += [f"{name} ({path.relative_to(ROOT)}) inherits {b}" for b in project]
    assert not big, big
    assert not mixins, mixins

"""The disk cache of the compiled loops (expertcache.compiled) is keyed by the modules a loop's module imports, not
only by its own file: on a package of its own (a constant imported by name, a helper inlined from another
module, as models/fused.py inlines routing/kernels.py and cache/base.py), an edit to either recompiles the
loop, while numba's stock ``cache=True`` keeps running the stale one. Each run is a fresh process sharing one
NUMBA_CACHE_DIR, as two runs of the command line do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache import compiled

SRC = Path(__file__).resolve().parents[1] / "src"

LOOP = """\
import numba

from expertcache.compiled import jit
from depdemo.consts import K
from depdemo import helpers


@jit
def ours(x):
    return helpers.add(x) * K


@numba.njit(cache=True)
def stock(x):
    return helpers.add(x) * K
"""

RUN = ("import depdemo.loop as m\n"
       "print(m.ours(1), m.stock(1), sum(m.ours.stats.cache_hits.values()), sum(m.stock.stats.cache_hits.values()))")


def _write(pkg: Path, k: int, add: int) -> None:
    (pkg / "consts.py").write_text(f"K = {k}\n")
    (pkg / "helpers.py").write_text("from expertcache.compiled import jit_inline\n\n\n@jit_inline\n"
                                    f"def add(x):\n    return x + {add}\n")


def _run(tmp: Path) -> tuple[int, int, int, int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp), str(SRC)]), NUMBA_CACHE_DIR=str(tmp / "numba"))
    env.pop("EXPERTCACHE_NO_NUMBA", None)
    proc = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return tuple(int(x) for x in proc.stdout.split())


@pytest.mark.skipif(not compiled.AVAILABLE, reason="needs numba (the pure-Python paths have no compiled cache)")
def test_an_edit_to_an_imported_module_recompiles_the_loop(tmp_path):
    pkg = tmp_path / "depdemo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "loop.py").write_text(LOOP)
    _write(pkg, k=1, add=10)
    assert _run(tmp_path) == (11, 11, 0, 0)  # compiled, cached
    assert _run(tmp_path) == (11, 11, 1, 1)  # both loaded from the disk cache
    _write(pkg, k=2, add=10)  # the constant's module edited
    ours, stock, hits, _ = _run(tmp_path)
    assert (ours, hits) == (22, 0)  # recompiled with K = 2
    assert stock == 11, "numba's stock cache now notices imported modules: expertcache.compiled may be simplified"
    _write(pkg, k=2, add=20)  # the inlined helper's module edited
    assert _run(tmp_path)[0::2] == (42, 0)
    assert _run(tmp_path)[0::2] == (42, 1)  # and cached again


def test_dependency_files_follow_module_level_imports_transitively(tmp_path, monkeypatch):
    """``from pkg import sub`` (a module), ``from .x import name``, ``import pkg.y as z`` and names re-exported by
    a package's __init__ are followed; imports inside functions are not (nothing compiled reads them)."""
    pkg = tmp_path / "deptree"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\nfrom deptree import b\nfrom .sub import thing\nimport deptree.c as c\n\n"
                              "def f():\n    from deptree import lazy\n")
    (pkg / "b.py").write_text("from deptree.d import (\n    X,\n    Y,\n)\n")
    (pkg / "c.py").write_text("")
    (pkg / "d.py").write_text("X = Y = 1\n")
    (pkg / "lazy.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from deptree.sub.inner import thing\n")
    (pkg / "sub" / "inner.py").write_text("thing = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import deptree.a  # noqa: F401

    got = {p.relative_to(pkg).as_posix() for p in compiled.dependency_files("deptree.a")}
    assert got == {"b.py", "c.py", "d.py", "sub/__init__.py", "sub/inner.py"}
    before = compiled.dependency_digest("deptree.a")
    (pkg / "d.py").write_text("X = Y = 22\n")
    assert compiled.dependency_digest("deptree.a") != before

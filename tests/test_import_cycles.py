"""No import cycle under src/expertcache, imports inside functions included.

Every ``import`` / ``from ... import`` of every module (module level, inside functions and classes, under
``if TYPE_CHECKING`` too: an import is an edge wherever it is written), relative ones resolved, is an edge
from the importing module to the imported one. ``from pkg import name`` where ``pkg.name`` is a module is an
edge to that module, else to ``pkg`` (its ``__init__``).

How a package's ``__init__`` counts: it is a module of its own, ``expertcache.offload`` (file
``offload/__init__.py``). Importing ``expertcache.offload.store`` runs ``expertcache.offload`` first, but
that implicit parent edge is NOT counted: a package's ``__init__`` re-exports its submodules' public names
(an edge ``__init__ -> submodule``), and counting the parent edge too would make every re-export a cycle.
So an ``__init__`` is a module like any other: it may re-export from its own submodules, and a submodule must
not import from its package's ``__init__`` (``from expertcache.offload import X`` inside ``offload/``),
which is an explicit edge and does close a cycle.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "expertcache"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The expertcache modules ``name`` (file ``path``) imports, wherever in the file."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # ``import a.b.c`` of a name inside a module: the module
                t = t.rpartition(".")[0]
            if t.startswith("expertcache") and t in modules and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``g`` as [a, b, ..., a], or None (iterative depth-first search)."""
    colour = {n: 0 for n in g}  # 0 unseen, 1 on the stack, 2 done
    for start in sorted(g):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(g[start])))]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
            elif colour[nxt] == 1:
                path = [n for n, _ in stack]
                return path[path.index(nxt):] + [nxt]
            elif colour[nxt] == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(g[nxt]))))
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    """The graph builder itself: an import inside a function and a relative import are edges, and a cycle
    through them is found."""
    pkg = tmp_path / "expertcache" / "p"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from expertcache.p.a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text("import expertcache.p.c\n")
    (pkg / "c.py").write_text("def h():\n    from expertcache.p import a\n")
    (tmp_path / "expertcache" / "__init__.py").write_text("")
    mods = {_module_name_under(p, tmp_path): p for p in (tmp_path / "expertcache").rglob("*.py")}
    g = {n: _edges(n, p, mods) for n, p in mods.items()}
    assert g["expertcache.p.a"] == {"expertcache.p.b"}
    assert g["expertcache.p.c"] == {"expertcache.p.a"}
    assert g["expertcache.p"] == {"expertcache.p.a"}
    cycle = find_cycle(g)
    assert cycle is not None and set(cycle) == {"expertcache.p.a", "expertcache.p.b", "expertcache.p.c"}
    (pkg / "c.py").write_text("")
    assert find_cycle({n: _edges(n, p, mods) for n, p in mods.items()}) is None


def _module_name_under(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)

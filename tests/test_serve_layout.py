"""The server as routes over small modules (issue 46): no file of ``serve/`` over 600 lines, and no import cycle
among its modules, imports inside functions included (parsed, not imported)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVE = Path(__file__).resolve().parents[1] / "src" / "expertcache" / "serve"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("expertcache.serve"):
            if node.module == "expertcache.serve":
                out.update(f"expertcache.serve.{a.name}" for a in node.names)
            else:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("expertcache.serve."))
    return out


def test_no_serve_file_over_600_lines():
    long = {p.name: n for p in SERVE.glob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_no_import_cycle_in_serve():
    graph = {f"expertcache.serve.{p.stem}": _imports(p) for p in SERVE.glob("*.py") if p.stem != "__init__"}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != 1, " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert "expertcache.serve.app" not in graph["expertcache.serve.liveview"]

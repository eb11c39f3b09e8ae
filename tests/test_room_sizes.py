"""Rooms one can hold in one's head (issue 46), pinned for every package under src/expertcache: no file over 600
lines, no class over 500 lines counting the project classes it inherits from, and no class that inherits from a
mixin to gain state (composition: a part holds the parts it calls).

What counts as inheritance from a project class: a base that names a class defined in the same file or imported
from ``expertcache`` (``uvicorn.Server`` is not ``serve/server.py``'s ``Server``). A class inherits from no
project class, except from the bases of ``BASES``: each one a base meant to be subclassed (an interface: the
eviction rules' cache, a task, a config dataclass, HF's pretrained-model pattern) that builds its own state.
A *state mixin* is a class with no constructor anywhere in its line (no ``__init__``/``__new__``, not a dataclass,
no base outside the project) whose methods use attributes of ``self`` it does not define: state set up by the
class that inherits it. No base is one, listed or not."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "expertcache"
PACKAGES = tuple(sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()))
MAX_FILE, MAX_CLASS = 600, 500
# project bases a class may inherit from, and why (each checked below not to be a state mixin)
BASES = {
    "ExpertCache": "cache/base.py: the eviction rules' common cache (its __init__ builds the state)",
    "LFUCache": "cache/lfu.py: the discounted-frequency rule (gamma) refines LFU's eviction",
    "Task": "eval/tasks.py: the tasks' dataclass base (name, quality metric, scope)",
    "TrainConfig": "train/configs.py: a training config dataclass that MoLE's config extends with fields",
    "MolePreTrainedModel": "mole/modeling.py: transformers' PreTrainedModel pattern (config class, weight init)",
}
_NEUTRAL = {"object", "ABC", "Protocol", "Generic"}


class _Class:
    def __init__(self, path: Path, node: ast.ClassDef, project: set[str]):
        self.path, self.node = path, node
        self.lines = node.end_lineno - node.lineno + 1
        self.bases, self.external = [], []  # project base names; other bases
        for b in node.bases:
            root = b
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            name = ast.unparse(b.value if isinstance(b, ast.Subscript) else b).split(".")[-1]
            if isinstance(b, ast.Name) and b.id in project:
                self.bases.append(b.id)
            elif isinstance(b, ast.Attribute) and isinstance(root, ast.Name) and root.id in project:
                self.bases.append(name)
            elif name not in _NEUTRAL:
                self.external.append(name)

    def own_constructor(self) -> bool:
        n = self.node
        return (any(isinstance(f, ast.FunctionDef) and f.name in ("__init__", "__new__", "__post_init__")
                    for f in n.body)
                or any("dataclass" in ast.unparse(d) for d in n.decorator_list) or bool(self.external))

    def defined(self) -> set[str]:
        """Names the class body defines (methods, properties, class attributes, annotated fields)."""
        out = set()
        for s in self.node.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(s.name)
            elif isinstance(s, ast.Assign):
                out |= {t.id for t in s.targets if isinstance(t, ast.Name)}
            elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                out.add(s.target.id)
        return out

    def self_attributes(self) -> set[str]:
        return {a.attr for f in self.node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for a in ast.walk(f) if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)
                and a.value.id == "self"}


def _classes() -> dict[str, _Class]:
    """Every class under src/expertcache by name, its bases resolved to project classes where they are."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        project = {c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("expertcache")):
                project |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                project |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("expertcache")}
        for c in ast.walk(tree):
            if isinstance(c, ast.ClassDef):
                assert c.name not in out, f"two project classes named {c.name}: {out[c.name].path}, {p}"
                out[c.name] = _Class(p, c, project)
    return out


def _in_packages(path: Path) -> bool:
    rel = path.relative_to(ROOT).parts
    return len(rel) == 1 or rel[0] in PACKAGES  # top-level modules too


def test_every_package_is_covered():
    assert {"offload", "routing", "models", "serve", "cache"} <= set(PACKAGES), PACKAGES


def _files():
    return [p for p in sorted(ROOT.rglob("*.py")) if _in_packages(p)]


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_over_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_FILE, f"{path.relative_to(ROOT)}: {n} lines"


def test_no_class_over_500_lines_with_its_project_bases_and_no_mixin():
    classes = _classes()

    def total(name: str, seen: tuple = ()) -> int:
        if name not in classes or name in seen:
            return 0
        c = classes[name]
        return c.lines + sum(total(b, seen + (name,)) for b in c.bases)

    def constructed(name: str) -> bool:
        c = classes[name]
        return c.own_constructor() or any(constructed(b) for b in c.bases if b in classes)

    def defined(name: str) -> set[str]:
        c = classes[name]
        return c.defined().union(*(defined(b) for b in c.bases if b in classes))

    big, mixins, inherits = [], [], []
    for name, c in classes.items():
        if not _in_packages(c.path):
            continue
        where = f"{name} ({c.path.relative_to(ROOT)})"
        if total(name) > MAX_CLASS:
            big.append(f"{where}: {total(name)} lines")
        for b in c.bases:
            if b not in classes or b.endswith(("Error", "Exception", "Warning")):
                continue
            state = classes[b].self_attributes() - defined(b)
            if not constructed(b) and state:
                mixins.append(f"{where} inherits the state mixin {b} (self.{', self.'.join(sorted(state))})")
            elif b not in BASES:
                inherits.append(f"{where} inherits {b}: hold it as a part, or list it in BASES with the reason")
    assert not big, big
    assert not mixins, mixins
    assert not inherits, inherits


def test_the_listed_bases_exist():
    classes = _classes()
    assert set(BASES) <= set(classes), set(BASES) - set(classes)


def test_a_state_mixin_is_caught(tmp_path):
    """The detector itself, on the shape MoEPatch had: a base without a constructor using the subclass's state."""
    src = ("class Streams:\n    def reset(self):\n        self._rows = []\n        return self.capacity\n\n"
           "class Patch(Streams):\n    def __init__(self):\n        self.capacity = 1\n")
    tree = ast.parse(src)
    a, b = [_Class(tmp_path / "x.py", c, {"Streams", "Patch"}) for c in tree.body]
    assert b.bases == ["Streams"] and not a.own_constructor() and a.self_attributes() - a.defined() == {"_rows",
                                                                                                        "capacity"}

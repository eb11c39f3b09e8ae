"""The package's layering, pinned: no module imports (at top level or inside a function) from its own layer's
other packages or from a layer above it. docs/ARCHITECTURE.md describes the layers."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src" / "expertcache"

#: bottom to top; a package may import only from packages in lower layers (and from itself)
LAYERS = [
    {"jsonsafe", "container"},  # the one JSON reader; the memory cgroup's limit: import nothing of expertcache
    {"outputs", "tensorfile"},  # the output rule (paths, marks, temporary names); safetensors headers: read with jsonsafe
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


def test_the_layers_are_used():
    """Every package of LAYERS exists (a renamed package must be renamed here, not silently dropped)."""
    pkgs = {_package(p) for p in ROOT.rglob("*.py")}
    assert set(LAYER_OF) - {"__init__"} <= pkgs, sorted(set(LAYER_OF) - pkgs)


# -- no module reads another module's private state ----------------------------------------------------------

#: ``x._name`` (x not self/cls, ``_name`` not defined in the same file) that is allowed: (file or "*", name) → why.
#: Each is a library's private API with no public equivalent, or our own marker on a library object.
PRIVATE_ALLOWED = {
    ("*", "_SubParsersAction"): "argparse: the type of add_subparsers()'s result, for annotations (no public name)",
    ("cli/melinoe.py", "_actions"): "argparse: a parser's actions, to give --preset's fields a None default "
                                    "(argparse has no public iterator over them)",
    ("compiled.py", "_cache"): "numba: what cache=True sets on a dispatcher, keyed deeper (Dispatcher.enable_caching "
                               "has no key argument)",
    ("offload/q4moe.py", "_cache"): "numba: what cache=True sets on a CFunc (enable_caching), keyed deeper as compiled.py does",
    ("offload/q4moe.py", "_dependency_cache"): "compiled.py's cache keyed by the imports: the fused cfunc inlines q4x8's pieces",
    ("offload/q4moe.py", "_dot_plain"): "q4x8's inlined numba pieces, shared by the fused MoE kernel (q4x8.py at its size limit)",
    ("offload/q4moe.py", "_offsets"): "q4x8's inlined numba pieces, shared by the fused MoE kernel (q4x8.py at its size limit)",
    ("offload/q4moe.py", "_quantise"): "q4x8's inlined numba pieces, shared by the fused MoE kernel (q4x8.py at its size limit)",
    ("offload/q4moe.py", "_rows4_avx2"): "q4x8's inlined numba pieces, shared by the fused MoE kernel (q4x8.py at its size limit)",
    ("offload/q4moe.py", "_scale_f32"): "q4x8's inlined numba pieces, shared by the fused MoE kernel (q4x8.py at its size limit)",
    ("offload/q4moe.py", "_store_f32"): "q4x8's inlined numba pieces, shared by the fused MoE kernel (q4x8.py at its size limit)",
    ("models/adapters.py", "_version"): "torch: a tensor's in-place version counter (the router bias cache's key)",
    ("models/patch.py", "_expertcache_patch"): "our own marker set on the transformers model it patches",
    ("mole/configs.py", "_experts_implementation"): "transformers: the experts kernel a config selects (no setter)",
    ("train/configs.py", "_experts_implementation"): "the same",
    ("offload/loader.py", "_non_persistent_buffers_set"): "torch: which buffers state_dict leaves out (no public "
                                                          "accessor), to load only the persistent ones",
    ("serve/attention.py", "_attn_implementation"): "transformers: the attention a config selects (read only)",
    ("models/captured.py", "_attn_implementation"): "the same: the captured step's mask suits sdpa and eager only",
    ("models/captured.py", "_dynamo"): "torch: torch.compile's recompile limit (torch._dynamo.config; no public "
                                       "setter), raised to one graph per decoder layer by --compile",
    ("models/captured.py", "_eager_forward"): "the plain forward compile_dense keeps on each module it wraps, read "
                                              "back in the same file (the captured step and its prefill run it)",
    ("offload/views.py", "_dynamo"): "torch: mark_static_address (no public name; transformers' StaticCache marks "
                                    "its tensors the same way), so CUDA graphs read the slot arena in place",
    **{("models/captured.py", h): "torch: a module's forward hooks (no public accessor); a hooked MoE block stays "
                                   "opaque in the captured step" for h in ("_forward_hooks", "_forward_pre_hooks")},
    ("offload/layout.py", "_grouped_mm"): "torch's grouped GEMM (no public name; transformers' grouped_mm experts "
                                        "call it the same way)",
    ("offload/experts.py", "_serve"): "OffloadedExperts is the runtime's own forward seam inside the model: the "
                                      "model's experts call the runtime's layer step (offload/step.py), nothing else",
    **{("offload/quant.py", op): "torch's fused int4/int8 weight kernels (aten ops with no public name; gpt-fast and "
                                  "torchao call them the same way)"
       for op in ("_convert_weight_to_int4pack", "_convert_weight_to_int4pack_for_cpu", "_weight_int8pack_mm",
                  "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu")},
    ("offload/fbgemm.py", "_make_per_channel_quantized_tensor"): "torch's qint8 tensor around existing int8 codes "
                                                                  "(no public name): FBGEMM packed from the codes, "
                                                                  "no float copy of the matrix",
    ("offload/fbexperts.py", "_convert_weight_to_int4pack_for_cpu"): "torch's int4 packing (aten op, no public "
                                                                     "name), of random codes for the kernel timing",
    ("melinoe/predictor.py", "_check_out"): "melinoe's --out check, shared by its two commands (finetune.py, "
                                            "predictor.py); to be replaced by cli/common's output checks (issue 32)",
}


def _defined_here(tree: ast.AST) -> set[str]:
    """Names a file defines for its own objects: functions, classes, module names, ``self.X``/``cls.X`` stores,
    ``__slots__`` entries, parameters, imports."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and ast.unparse(n.value) in ("self", "cls"):
            names.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
            names |= {c.value for c in ast.walk(n.value) if isinstance(c, ast.Constant)}
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return names


def test_no_module_reads_private_state_of_another():
    """In src/, ``obj._name`` on anything but ``self``/``cls`` is either a name the same file defines (its own
    classes' state) or in ``PRIVATE_ALLOWED`` with its reason, and so is ``from expertcache... import _name``: a module asks another through a public method
    (``Engine.run_if_idle``, ``DiskTier.fd``, ``Ticket.join``, ``ExpertCache.kernel_served``, ...) instead of
    reaching into its private state, so that state can change without breaking a reader elsewhere."""
    found, used = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), rel)
        own = _defined_here(tree)
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            if ast.unparse(n.value) in ("self", "cls") or n.attr in own:
                continue
            key = next((k for k in ((rel, n.attr), ("*", n.attr)) if k in PRIVATE_ALLOWED), None)
            if key is None:
                found.append(f"{rel}:{n.lineno}: {ast.unparse(n)}")
            used.add(key)
        for n in ast.walk(tree):  # ``from expertcache.x import _name``: the same, through an import
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("expertcache"):
                for a in n.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        if (rel, a.name) in PRIVATE_ALLOWED:
                            used.add((rel, a.name))
                        else:
                            found.append(f"{rel}:{n.lineno}: from {n.module} import {a.name}")
    assert not found, "private state of another module (add a public accessor, or allow it with a reason):\n" + \
        "\n".join(found)
    assert used >= set(PRIVATE_ALLOWED), f"allowed but no longer used: {sorted(set(PRIVATE_ALLOWED) - used)}"


def test_the_private_access_check_sees_what_it_must():
    """The check itself: another object's private attribute read or set is found; self's, a same-file class's and
    an allowed one are not."""
    src = ("class A:\n    def __init__(self):\n        self._mine = 1\n    def f(self, other, eng):\n"
           "        other._mine; eng._lock; eng._waiting = 2; self._x\n")
    tree = ast.parse(src)
    own = _defined_here(tree)
    seen = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and ast.unparse(n.value) not in ("self", "cls") and n.attr not in own]
    assert sorted(seen) == ["eng._lock", "eng._waiting"]


# -- the offloaded runtime's parts import only downward ------------------------------------------------------

#: offload/'s modules bottom to top (docs/ARCHITECTURE.md, "The offloaded runtime's parts"): each may import only
#: the modules before it; the runtime assembles the parts and nothing below imports it
OFFLOAD_ORDER = ["checkpoint", "diskembed", "groupfit", "team", "q4x8", "q8x8", "q4moe", "hostnorm", "quant", "fbexperts", "binding", "writer", "densecache", "config",
                 "budget", "fbgemm", "ioqueue", "observe",
                 "prefetch", "generate",
                 "layout", "qlinear", "kernelnote", "experts", "store", "loader", "tiers", "lowtier", "slots", "views", "reads",
                 "step", "routes", "stats", "capture", "preflight", "make_model", "runtime", "bench", "__init__"]

#: the parts that know nothing of transformers (the runtime, the loader and make_model are the ones that do)
NO_TRANSFORMERS = {"diskembed", "groupfit", "team", "hostnorm", "layout", "store", "slots", "views", "reads", "step", "routes", "observe", "generate", "stats",
                   "capture", "ioqueue", "checkpoint", "binding", "densecache", "fbgemm"}


def _offload_imports(path: Path) -> tuple[set[str], set[str]]:
    """(the offload modules ``path`` imports, the top-level packages it imports), anywhere in the file."""
    mods, tops = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            tops.add(parts[0])
            if parts[:2] == ["expertcache", "offload"] and len(parts) > 2 and parts[2] in OFFLOAD_ORDER:
                mods.add(parts[2])
    return mods, tops


def test_every_offload_module_has_a_place():
    have = {p.stem for p in (ROOT / "offload").glob("*.py")}
    assert have == set(OFFLOAD_ORDER), (sorted(have - set(OFFLOAD_ORDER)), sorted(set(OFFLOAD_ORDER) - have))


@pytest.mark.parametrize("name", OFFLOAD_ORDER)
def test_offload_parts_import_only_downward(name):
    mods, tops = _offload_imports(ROOT / "offload" / f"{name}.py")
    above = sorted(m for m in mods if OFFLOAD_ORDER.index(m) >= OFFLOAD_ORDER.index(name) and m != name)
    assert not above, f"offload/{name}.py imports {above}, at or above it in OFFLOAD_ORDER"
    if name in NO_TRANSFORMERS:
        assert "transformers" not in tops, f"offload/{name}.py imports transformers"

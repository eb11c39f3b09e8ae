"""The optional numba backend of the compiled loops (:mod:`expertcache.cache.lru`,
:mod:`expertcache.routing.kernels`, :mod:`expertcache.models.fused`, :mod:`expertcache.offload.groupfit`), in one
place.

``AVAILABLE`` is False when numba is not installed or ``EXPERTCACHE_NO_NUMBA`` is set (to anything but
``0``); then :func:`jit` and :func:`jit_inline` return the function unchanged and callers take their
pure-Python paths, which make the same decisions.

Compiled code is cached on disk, keyed by its dependencies too. numba's own cache keys a function by its
source file alone, but a compiled loop also bakes in what it calls and reads from other modules (the
fused loop of ``models/fused.py`` inlines the kernels of ``routing/kernels.py`` and ``cache/base.py``; a
module-level int imported by name is frozen as a constant): an edit there would leave numba loading a stale
loop. So each function's cache entry is stamped with numba's stamp of its own file *and*
:func:`dependency_digest` of the package's modules its module imports at module level, transitively
(:func:`dependency_files`); an edit to any of them makes the entry stale and the loop is compiled again. Nothing
is pasted by hand. Where no cache location is writable, functions are compiled per process.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
from pathlib import Path

try:
    import numba
except ImportError:  # pragma: no cover - exercised on installs without numba
    numba = None
if os.environ.get("EXPERTCACHE_NO_NUMBA", "") not in ("", "0"):
    numba = None

__all__ = ["AVAILABLE", "jit", "jit_inline", "jit_each", "cfunc", "dependency_files", "dependency_digest", "compile_notice"]

AVAILABLE = numba is not None

# module-level import statements (column 0): ``from X import a, (b, c)`` and ``import X.Y as Z, W``
_FROM = re.compile(r"^from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)", re.M)
_IMPORT = re.compile(r"^import[ \t]+([^\n#]+)", re.M)


def _package_of(module: str) -> tuple[str, Path] | None:
    """(top-level package name, its folder) of ``module``; None outside a package."""
    top = sys.modules.get(module.split(".")[0])
    paths = getattr(top, "__path__", None)
    return (top.__name__, Path(list(paths)[0])) if top is not None and paths else None


def _file_of(root: Path, top: str, module: str) -> Path | None:
    """The source file of package module ``module`` (``top.a.b`` -> root/a/b.py or root/a/b/__init__.py)."""
    if module != top and not module.startswith(top + "."):
        return None
    rel = module.split(".")[1:]
    for p in (root.joinpath(*rel, "__init__.py"), root.joinpath(*rel[:-1], rel[-1] + ".py") if rel else None):
        if p is not None and p.is_file():
            return p
    return None


def _imports(module: str, path: Path, top: str, root: Path) -> set[str]:
    """The package modules ``module`` (source ``path``) imports at module level (names, not files)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for src, names in _FROM.findall(text):
        if src.startswith("."):  # relative: one dot is this package
            dots = len(src) - len(src.lstrip("."))
            base = package.rsplit(".", dots - 1)[0] if dots > 1 else package
            src = base + ("." + src.lstrip(".") if src.lstrip(".") else "")
        names = [n.split(" as ")[0].strip() for n in names.strip("()").replace("\n", " ").split(",")]
        names = [n for n in (n.split("#")[0].strip() for n in names) if n and n != "*"]
        subs = [f"{src}.{n}" for n in names if _file_of(root, top, f"{src}.{n}") is not None]
        out.update(subs)
        if len(subs) < len(names) or not names:  # a name defined in (or re-exported by) ``src`` itself
            out.add(src)
    for spec in _IMPORT.findall(text):
        out.update(part.split(" as ")[0].strip() for part in spec.split(","))
    return {m for m in out if _file_of(root, top, m) is not None}


@functools.lru_cache(maxsize=None)
def _dependencies(module: str) -> tuple[Path, ...]:
    pkg = _package_of(module)
    if pkg is None:
        return ()
    top, root = pkg
    own = _file_of(root, top, module)
    if own is None:
        return ()
    seen, todo = {module}, [module]
    while todo:
        m = todo.pop()
        for dep in _imports(m, _file_of(root, top, m), top, root):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return tuple(sorted({_file_of(root, top, m) for m in seen} - {own}))


def dependency_files(module: str) -> list[Path]:
    """The source files of the package modules that ``module`` imports at module level (column-0 ``import`` /
    ``from ... import`` statements, relative ones too), transitively, without ``module``'s own file: every
    module whose names a compiled function of ``module`` can reach. Empty outside a package."""
    return list(_dependencies(module))


@functools.lru_cache(maxsize=None)
def _file_digest(path: str, mtime_ns: int, size: int) -> bytes:
    return hashlib.sha256(Path(path).read_bytes()).digest()


def dependency_digest(module: str) -> str:
    """sha256 (hex) over :func:`dependency_files` of ``module`` (their paths inside the package and contents)."""
    h = hashlib.sha256()
    files = dependency_files(module)
    pkg = _package_of(module)
    for p in files:
        st = p.stat()
        h.update(p.relative_to(pkg[1]).as_posix().encode() + b"\0")
        h.update(_file_digest(str(p), st.st_mtime_ns, st.st_size))
    return h.hexdigest()


def _dependency_cache(fn):
    """numba's per-function disk cache, its entries stamped with :func:`dependency_digest` of ``fn``'s module
    beside numba's stamp of ``fn``'s own file (see the module docstring). Raises RuntimeError (numba's) when no
    cache location is usable."""
    from numba.core.caching import CompileResultCacheImpl, FunctionCache

    digest = dependency_digest(fn.__module__)

    class Locator:  # numba's chosen locator, with the dependencies in the source stamp
        def __init__(self, inner) -> None:
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def get_source_stamp(self):
            return (self._inner.get_source_stamp(), "expertcache-deps", digest)

    class Impl(CompileResultCacheImpl):
        def __init__(self, py_func) -> None:
            super().__init__(py_func)
            self._locator = Locator(self._locator)

    class Cache(FunctionCache):
        _impl_class = Impl

        def load_overload(self, sig, target_context):
            got = super().load_overload(sig, target_context)
            if got is None:  # not cached: numba compiles it now
                compile_notice()
            return got

    return Cache(fn)


_NOTICED = []


def compile_notice() -> None:
    """One line on stderr, once per process, before the first kernel is compiled (not loaded from the cache): the
    first run after installing compiles them all, 20-70 s of silence otherwise (offload/groupfit.py's on the first
    int4 quantisation)."""
    if not _NOTICED:
        _NOTICED.append(True)
        print("expertcache: compiling the routing, cache and int4 group-fit kernels with numba (once after installing "
              "or upgrading: 20-70 s; later runs load them from the cache)", file=sys.stderr, flush=True)


def _njit(fn, **options):
    disp = numba.njit(cache=False, nogil=True, **options)(fn)
    try:
        disp._cache = _dependency_cache(fn)  # what numba's cache=True sets (Dispatcher.enable_caching), keyed deeper
    except RuntimeError:  # no writable cache location (read-only install, no user cache dir): compile per process
        pass
    return disp


def jit(fn, **options):
    """Compile ``fn`` (nopython, no GIL, cached on disk where possible) when numba is available; ``options`` go to
    ``numba.njit`` (``fastmath={"reassoc"}``: a sum in any order)."""
    return _njit(fn, **options) if numba is not None else fn


def jit_inline(fn):
    """For helpers called from other compiled loops: inlined there (no per-call argument passing)."""
    return _njit(fn, inline="always") if numba is not None else fn


def jit_each(make, keys) -> tuple:
    """One compiled function per key from one source: ``make(key)`` returns a function that closes over
    ``key``, which numba compiles as a constant, so branches on it are dropped (each specialisation runs
    only its own rule). Indexed by key (keys 0, 1, ...)."""
    return tuple(jit(make(key)) for key in keys)


def cfunc(fn, argtypes, restype):
    """``fn`` compiled as a C callable (numba's ``CFunc``: ``.address``) taking ``argtypes`` (numba types) and
    returning ``restype``, cached on disk like :func:`jit`'s loops (keyed by its module and the package modules it
    imports) where a cache location is writable. Needs numba."""
    from numba.core.ccallback import CFunc

    cf = CFunc(fn, (tuple(argtypes), restype), locals={}, options={"nopython": True})
    try:
        cf._cache = _dependency_cache(fn)  # what CFunc.enable_caching sets, keyed deeper
    except RuntimeError:  # no writable cache location: compiled per process
        pass
    cf.compile()
    return cf

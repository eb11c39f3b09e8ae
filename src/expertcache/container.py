"""The memory container this process runs in, read without torch: ``expertcache``'s command line checks it
before importing anything heavy (a cgroup smaller than the interpreter itself would kill the process while
it imports torch, before any memory plan could refuse the run), and the memory plan
(:mod:`expertcache.offload.budget`) plans within it.

Contract: :func:`cgroup_memory_limit` is the smallest limit of this process's memory cgroup and its visible
ancestors in bytes (v1 ``memory.limit_in_bytes``, v2 ``memory.max``), None where none is set; a limit file
that holds no byte count is a ValueError naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cgroup_memory_limit", "cgroup_memory_usage", "IMPORT_FLOOR", "check_import_floor"]

#: cgroup v1 writes "no limit" as PAGE_COUNTER_MAX rounded to pages (9223372036854771712); anything this
#: large is no limit
_NO_LIMIT = 2**60

#: resident memory of a process that has imported torch, transformers and the offloaded runtime, before it
#: loads any model (measured 304 MiB on Linux x86-64, torch 2.13 CPU, transformers 5.23; the plan's baseline
#: adds the compiled kernels on top): a memory cgroup below this cannot even start a model-loading command.
#: Every command imports torch (``simulate`` of a small trace peaks at 343 MiB, ``report`` 318, ``analyze`` 285):
#: all are checked against it.
IMPORT_FLOOR = 384 * 2**20


def _cgroup_value(path: Path) -> int | None:
    """A cgroup memory limit file's bytes; None for 'max' or v1's "no limit"; ValueError naming the file for
    anything else that is not a byte count."""
    text = path.read_text().strip()
    if text == "max":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{path}: cannot read a memory limit from {text[:40]!r}") from None
    if n < 0:
        raise ValueError(f"{path}: negative memory limit {n}")
    return None if n >= _NO_LIMIT else n


def _memory_cgroups(root: Path, v1_name: str, v2_name: str) -> list[tuple[Path, list[str], str]]:
    """(controller folder, this process's cgroup path steps, file name) of each memory hierarchy in
    ``root``/proc/self/cgroup: v1's ``memory`` controller with ``v1_name``, v2's unified one with ``v2_name``."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, rel = parts
        if "memory" in controllers.split(","):
            out.append((root / "sys/fs/cgroup/memory", [s for s in rel.split("/") if s], v1_name))
        elif hierarchy == "0" and controllers == "":
            out.append((root / "sys/fs/cgroup", [s for s in rel.split("/") if s], v2_name))
    return out


def cgroup_memory_limit(root: str | os.PathLike = "/") -> int | None:
    """The memory limit in bytes of the cgroup this process runs in: the smallest over its cgroup and the
    ancestors visible under the mount; None where there is none. Reads ``<root>/proc/self/cgroup``; cgroup v1
    (a line ``N:...memory...:/path``): ``<root>/sys/fs/cgroup/memory/<path>/memory.limit_in_bytes``; cgroup
    v2 (``0::/path``): ``<root>/sys/fs/cgroup/<path>/memory.max`` ('max' = none). A container that mounts its
    own cgroup at the root (the path is not visible) is read there. ``root``: a fake tree, for tests."""
    limits = []
    for base, steps, name in _memory_cgroups(Path(root), "memory.limit_in_bytes", "memory.max"):
        for depth in range(len(steps) + 1):
            f = base.joinpath(*steps[:depth], name)
            if f.is_file():
                n = _cgroup_value(f)
                if n is not None:
                    limits.append(n)
    return min(limits) if limits else None


def cgroup_memory_usage(root: str | os.PathLike = "/") -> int | None:
    """Bytes charged now to this process's memory cgroup (v1 ``memory.usage_in_bytes``, v2 ``memory.current``
    of its own cgroup, read as :func:`cgroup_memory_limit` finds it); None where there is none. Pages of shared
    libraries that another cgroup paged in first are charged there, not here (a cgroup's charge can be well below
    the process's RSS: 356 MB against 535 MB for ``generate`` at its memory plan)."""
    for base, steps, name in _memory_cgroups(Path(root), "memory.usage_in_bytes", "memory.current"):
        for f in (base.joinpath(*steps, name), base / name):  # its own cgroup, or one mounted at the root
            if f.is_file():
                try:
                    return _cgroup_value(f)
                except (OSError, ValueError):
                    return None
    return None




_MODEL = ("train", "eval", "sweep", "sensitivity", "trace", "mole", "generate", "bench", "melinoe", "serve")


def check_import_floor(command: str, root: str | os.PathLike | None = None) -> str | None:
    """One line refusing ``command`` when this process's memory cgroup is smaller than :data:`IMPORT_FLOOR`
    (it would be killed while importing torch); None when it fits or no limit is set. ``root``: the file tree
    the cgroup is read from (default ``$EXPERTCACHE_CGROUP_ROOT`` or ``/``, as the memory plan reads it)."""
    if root is None:
        root = os.environ.get("EXPERTCACHE_CGROUP_ROOT", "").strip() or "/"
    try:
        limit = cgroup_memory_limit(root)
    except (OSError, ValueError):
        return None  # unreadable: the plan reads it again later and names the file
    if limit is None or limit >= IMPORT_FLOOR:
        return None
    return (f"the memory cgroup allows {limit / 2**20:.0f} MiB, less than the {IMPORT_FLOOR >> 20} MiB this process "
            + ("needs before it can load a model (Python, torch, transformers)" if command in _MODEL else
               "needs before it can start (Python, torch)") + "; give the cgroup more memory")

"""Live, read-only views of a registry dict (name -> declaration), for the names derived from it.

The routing-policy registry (``routing/registry.py: SPECS``) and the eviction-rule registry
(``cache/caches.py: EVICTIONS``) are plain dicts that ``register_policy`` / ``register_eviction`` change in
place. What other modules read from them -- the names of every policy, the Cache-Prior set, each policy's
strength field -- is a view here, not a copy: a ``from ... import POLICIES`` made before a registration still
sees the registered name (argparse choices and help built from it, ``in`` checks, iteration).

:class:`Names`: the names whose declaration satisfies ``keep``, in registration order; a sequence (``in``,
``len``, iteration, indexing) equal to the tuple of the same names. :class:`Field`: a mapping name -> one
value of the declaration (``get``, ``items``, ...), over the declarations satisfying ``keep``.
:func:`unregister` and :func:`registered` are the removal and the scoped registration both registries offer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["Names", "Field", "unregister", "registered", "NAME", "check_name"]

#: a registered policy or eviction name: no comma (sweep's --policies and --eviction are comma-separated lists),
#: no '+' (bench's original+lru pairs), no upper case
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def check_name(name: object, what: str) -> None:
    """ValueError unless ``name`` is a string matching :data:`NAME` (``what``: "policy", "eviction")."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{what} name must be lower-case letters, digits, '-', '_' or '.', got {name!r}")


def unregister(source: dict, builtin, name: str, what: str, lookup: Callable[[str], Any]) -> None:
    """Remove ``name`` from ``source``: ValueError for a built-in one (``builtin``), ``lookup``'s error (naming
    the known ones) for an unknown one. ``what`` names the kind in the message ("routing policy")."""
    if name in builtin:
        raise ValueError(f"{what} {name!r} is built in; only registered ones can be removed")
    lookup(name)
    del source[name]


@contextmanager
def registered(register: Callable[[Any], Any], source: dict, item: Any) -> Iterator[Any]:
    """``register(item)`` for the block only (tests): ``item.name`` leaves ``source`` on the way out."""
    register(item)
    try:
        yield item
    finally:
        source.pop(item.name, None)


def _always(_: Any) -> bool:
    return True


class Names(Sequence):
    """The names of ``source`` (a dict) whose value satisfies ``keep``, read at each use."""

    __slots__ = ("_source", "_keep")

    def __init__(self, source: dict, keep: Callable[[Any], bool] = _always) -> None:
        self._source, self._keep = source, keep

    def _now(self) -> tuple:
        keep = self._keep
        return tuple(name for name, value in self._source.items() if keep(value))

    def __contains__(self, name: object) -> bool:
        try:
            value = self._source.get(name, self)  # an unhashable name is simply not there
        except TypeError:
            return False
        return value is not self and bool(self._keep(value))

    def __iter__(self):
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())

    def __getitem__(self, index):
        return self._now()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Names, tuple, list)):
            return self._now() == tuple(other)
        return NotImplemented

    __hash__ = None  # changes with the registry

    def __add__(self, other):
        return self._now() + tuple(other)

    def __radd__(self, other):
        return tuple(other) + self._now()

    def __repr__(self) -> str:
        return repr(self._now())


class Field(Mapping):
    """name -> ``value(declaration)`` over the declarations of ``source`` that satisfy ``keep``, read at each use."""

    __slots__ = ("_source", "_value", "_keep")

    def __init__(self, source: dict, value: Callable[[Any], Any], keep: Callable[[Any], bool] = _always) -> None:
        self._source, self._value, self._keep = source, value, keep

    def __getitem__(self, name):
        decl = self._source[name]
        if not self._keep(decl):
            raise KeyError(name)
        return self._value(decl)

    def __iter__(self):
        keep = self._keep
        return iter([name for name, decl in self._source.items() if keep(decl)])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self.items()))

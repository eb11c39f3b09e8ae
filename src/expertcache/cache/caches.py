"""The eviction-rule registry: one :class:`EvictionRule` per name (``EVICTIONS``), read by the CLI, sweeps, the
runtime and the live view at the time of use, so a rule added with :func:`register_eviction` (a plugin, a test)
is accepted by all of them; :func:`make_cache` builds one layer's cache by name; :func:`resolve_capacity`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from expertcache.cache import base as _base
from expertcache.cache.base import DEFAULT_GAMMA, ExpertCache
from expertcache.cache.belady import BeladyCache
from expertcache.cache.discounted import DiscountedCache
from expertcache.cache.gamma import GammaCache
from expertcache.cache.lfu import LFUCache
from expertcache.cache.lru import LRUCache
from expertcache.registries import Names, check_name, registered, unregister

__all__ = ["EVICTION_POLICIES", "EVICTIONS", "LIVE_EVICTIONS", "EvictionRule", "eviction_rule", "evictions",
           "make_cache", "register_eviction", "registered_eviction", "resolve_capacity", "unregister_eviction"]


@dataclass(frozen=True)
class EvictionRule:
    """One eviction rule, declared once. ``cls``: the cache class (its ``code`` is the victim score of
    ``cache/base.py: serve_one``: LRU, COUNTS, BELADY, DISCOUNTED); ``params``: the make_cache keywords it reads (e.g.
    ``("gamma",)``), so a row records them only where they mean something; ``admits``: every miss becomes
    resident (False: a miss may be a transient load); ``offline``: needs the future requests (a bound, not
    runnable live)."""

    name: str
    cls: type
    params: tuple[str, ...] = ()
    admits: bool = True
    offline: bool = False

    def settings(self, **values) -> dict:
        """The subset of ``values`` (e.g. ``gamma=0.5``) this rule reads: what a result row should carry."""
        return {k: values[k] for k in self.params if k in values}

    @property
    def code(self) -> int:
        return self.cls.code


EVICTIONS: dict[str, EvictionRule] = {r.name: r for r in (
    EvictionRule("lru", LRUCache),
    EvictionRule("lfu", LFUCache),
    EvictionRule("gamma", DiscountedCache, params=("gamma",), admits=False),
    EvictionRule("gamma-admit", GammaCache, params=("gamma",)),
    EvictionRule("belady", BeladyCache, admits=False, offline=True),
)}

#: the rules every install has (:func:`unregister_eviction` refuses them)
BUILTIN = frozenset(EVICTIONS)

#: every registered rule's name (a live view of EVICTIONS: a later registration is seen)
EVICTION_POLICIES = Names(EVICTIONS)
#: the rules a live run can use (not offline: Belady needs the future)
LIVE_EVICTIONS = Names(EVICTIONS, lambda r: not r.offline)

#: what each victim score of ``base.serve_one`` implies: code -> (admits every miss, needs the future)
_CODE_RULE = {_base.LRU: (True, False), _base.COUNTS: (True, False), _base.BELADY: (False, True),
              _base.DISCOUNTED: (False, False)}
#: the make_cache keywords a rule may read
_PARAMS = ("gamma",)


def evictions() -> tuple[str, ...]:
    """The names of every registered eviction rule, in registration order."""
    return tuple(EVICTIONS)


def eviction_rule(name: str) -> EvictionRule:
    """The registered rule called ``name``; an unknown name raises ValueError listing the known ones."""
    rule = EVICTIONS.get(name) if isinstance(name, str) else None
    if rule is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(EVICTIONS)}")
    return rule


def register_eviction(rule: EvictionRule) -> EvictionRule:
    """Add the eviction rule ``rule``: from now on ``make_cache``, ``--eviction`` (every command; sweep's list),
    the sweep plan, the simulator, the closed loop, the offloaded runtime and the live view accept ``rule.name``.
    ValueError, before anything changes, for a name already registered, a class that is no ``ExpertCache``, a
    ``code`` without a victim score in ``cache/base.py: serve_one``, ``admits``/``offline`` that contradict
    that score, or parameters make_cache does not have. Returns ``rule``."""
    if not isinstance(rule, EvictionRule):
        raise ValueError(f"register_eviction takes an EvictionRule, got {type(rule).__name__}")
    name = rule.name
    check_name(name, "eviction")
    if name in EVICTIONS:
        raise ValueError(f"eviction rule {name!r} is already registered")
    if not (isinstance(rule.cls, type) and issubclass(rule.cls, ExpertCache)):
        raise ValueError(f"eviction rule {name!r}: cls must be an ExpertCache subclass, got {rule.cls!r}")
    code = rule.cls.code
    if isinstance(code, bool) or code not in _CODE_RULE:
        raise ValueError(f"eviction rule {name!r}: {rule.cls.__name__}.code {code!r} has no victim score in "
                         f"cache/base.py: serve_one (known codes {sorted(_CODE_RULE)})")
    if (rule.admits, rule.offline) != _CODE_RULE[code]:
        raise ValueError(f"eviction rule {name!r}: code {code} means admits={_CODE_RULE[code][0]}, "
                         f"offline={_CODE_RULE[code][1]}; got admits={rule.admits!r}, offline={rule.offline!r}")
    if not isinstance(rule.params, tuple) or not set(rule.params) <= set(_PARAMS):
        raise ValueError(f"eviction rule {name!r}: params must be a tuple among {_PARAMS}, got {rule.params!r}")
    EVICTIONS[name] = rule
    return rule


def unregister_eviction(name: str) -> None:
    """Remove a rule added with :func:`register_eviction` (the built-in ones stay)."""
    unregister(EVICTIONS, BUILTIN, name, "eviction rule", eviction_rule)


def registered_eviction(rule: EvictionRule):
    """``with registered_eviction(EvictionRule(...)):`` the rule exists inside the block only (tests)."""
    return registered(register_eviction, EVICTIONS, rule)


def resolve_capacity(spec: float | int | str, num_experts: int) -> int:
    """Cache capacity C from an integer count (``16``) or a fraction of N (``0.5``; rounded, at least 1).

    Raises ValueError for C < 1 or C > N.
    """
    text = str(spec).strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"capacity must be an expert count or a fraction of N, got {spec!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"capacity must be a finite expert count or fraction of N, got {spec!r}")
    if "." not in text and not (0 < value < 1) and value != int(value):
        raise ValueError(f"capacity must be a whole expert count or a fraction of N, got {spec!r}")
    if "." in text or (0 < value < 1):
        if not 0 < value <= 1:
            raise ValueError(f"capacity fraction must be in (0, 1], got {spec!r}")
        capacity = max(1, round(value * num_experts))
    else:
        capacity = int(value)
    if not 1 <= capacity <= num_experts:
        raise ValueError(f"cache capacity must be between 1 and N={num_experts} experts, got {capacity}")
    return capacity


def make_cache(
    kind: str,
    num_experts: int,
    capacity: int,
    *,
    initial: str | Iterable[int] | None = None,
    seed: int = 0,
    gamma: float = DEFAULT_GAMMA,
    future: Sequence[Sequence[int]] | None = None,
    expert_bytes: int | Sequence[int] | None = None,
) -> ExpertCache:
    """Build one layer's cache. ``kind`` is one of ``EVICTION_POLICIES``; ``gamma`` is used by the rules that
    read it ('gamma', 004's Definition C.1 cache, and 'gamma-admit'), ``future`` (the steps to be served) is
    required by an offline rule ('belady')."""
    rule = eviction_rule(kind)
    kw = dict(initial=initial, seed=seed, expert_bytes=expert_bytes, **rule.settings(gamma=gamma))
    if rule.offline:
        if future is None:
            raise ValueError(f"the {kind} cache needs the future request sequence (an offline bound)")
        kw["future"] = future
    return rule.cls(num_experts, capacity, **kw)

"""The routing-policy registry: every policy declared once, as a :class:`PolicySpec`, and read by the policy
kernel's dispatch (``kernels.pack``), :class:`~expertcache.routing.RoutingConfig`, the command-line flags,
sweep grids, bench, the live view, reports' colours and the miss-rate controller -- each at the time of use, so a
policy added with :func:`register_policy` (a plugin, a test) is accepted by all of them.

Plain data: the kernels (layer 1's lowest module) read it too; the derived names (``POLICIES``, ``STRENGTH``,
``CACHE_PRIOR``, ...) are live views of ``SPECS`` (:mod:`expertcache.registries`), never copies. Adding a
policy: a ``PolicySpec`` here (or :func:`register_policy` from outside), its key rule in ``kernels.py:
token_keys`` and ``codes.KERNEL_CODES`` under a new ``code`` unless it reuses one, an oracle in ``tests/oracles.py``
(docs/ARCHITECTURE.md, "Add a routing policy").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from expertcache.registries import Field, Names, check_name, registered, unregister
from expertcache.routing.codes import KERNEL_CODES

__all__ = ["PolicySpec", "SPECS", "POLICIES", "STRENGTH", "STRENGTH_RANGES", "DEFAULT_TOP_J", "CACHE_PRIOR", "CODES", "NEEDS_PROBS",
           "STEERABLE", "NEEDS_PROFILE", "spec", "policies", "policy_colour", "register_policy", "unregister_policy",
           "registered_policy"]


@dataclass(frozen=True)
class PolicySpec:
    """One routing policy.

    name: the ``--policy`` value. code: its key rule in ``kernels.token_keys`` (None: residency-independent,
    ranked in torch: original top-K, pruning). strength: the :class:`RoutingConfig` field that is its strength
    (0 = original routing; None: no strength). top_j: the top-J it keeps when none is given (001's policies 1,
    003's ERAS 0). running_delta: keys read 001's running Δavg (Eq. 10). needs_probs: keys read the router
    probabilities. needs_profile: needs an activation-frequency profile (ERAS biasing). steer: (s_min, s_max,
    s0) of the miss-rate controller when the policy's strength can be steered to a target, else None.
    colour: its colour in figures (None: a default one). miss_costs: keys read each expert's load cost
    (:meth:`~expertcache.routing.Router.set_miss_costs`, cost-aware Cache-Prior)."""

    name: str
    code: int | None
    strength: str | None
    top_j: int = 1
    running_delta: bool = False
    needs_probs: bool = False
    needs_profile: bool = False
    steer: tuple[float, float, float] | None = None
    colour: str | None = None
    miss_costs: bool = False


SPECS: dict[str, PolicySpec] = {s.name: s for s in (
    PolicySpec("original", None, None, colour="black"),
    PolicySpec("prune", None, "h", colour="tab:gray"),
    PolicySpec("max-rank", 1, "m", colour="tab:orange"),
    PolicySpec("cumsum", 3, "p", needs_probs=True, colour="tab:green"),
    PolicySpec("cache-prior", 0, "lam", running_delta=True, steer=(1e-3, 1.0, 0.2), colour="tab:purple"),
    PolicySpec("eras-threshold", 4, "alpha", top_j=0, needs_probs=True, colour="tab:blue"),
    PolicySpec("eras-bias", 2, "beta", top_j=0, needs_profile=True, steer=(1e-3, 8.0, 1.0), colour="tab:cyan"),
    PolicySpec("cache-prior-cost", 5, "lam", running_delta=True, miss_costs=True, colour="tab:pink"),
)}

#: the real-valued strength fields of :class:`~expertcache.routing.RoutingConfig` and their ranges, (low, high;
#: None: unbounded): p (001 Alg. 2) and λ (001 Eq. 9) are fractions, α (003) and β (003) non-negative. The
#: whole-number ones are h (prune, 1..K) and m (max-rank, K..N). Read by RoutingConfig's checks, the kernel's
#: strength slot, sweep grids and flags, lm-eval's model_args and the registry's check of ``steer``.
STRENGTH_RANGES = {"p": (0.0, 1.0), "lam": (0.0, 1.0), "alpha": (0.0, None), "beta": (0.0, None)}

#: the policies every install has (:func:`unregister_policy` refuses them)
BUILTIN = frozenset(SPECS)

# Live views of SPECS (read at each use; a later registration is seen through an earlier import)
POLICIES = Names(SPECS)
#: which hyper-parameter is a policy's strength (0 = original routing), for sweeps and reports
STRENGTH = Field(SPECS, lambda s: s.strength)
#: top-J each policy uses when none is given
DEFAULT_TOP_J = Field(SPECS, lambda s: s.top_j)
#: Cache-Prior and its cost-aware variant (λ, running Δavg)
CACHE_PRIOR = Names(SPECS, lambda s: s.running_delta)
#: policy -> kernel code
CODES = Field(SPECS, lambda s: s.code, lambda s: s.code is not None)
#: policies whose keys read the router probabilities
NEEDS_PROBS = Names(SPECS, lambda s: s.needs_probs)
#: policies the miss-rate controller can steer -> (s_min, s_max, s0)
STEERABLE = Field(SPECS, lambda s: s.steer, lambda s: s.steer is not None)
#: policies that need an activation-frequency profile
NEEDS_PROFILE = Names(SPECS, lambda s: s.needs_profile)

#: the flags a kernel code's key rule reads (``codes.KERNEL_CODES``); a spec must set exactly those
_FLAGS = ("running_delta", "needs_probs", "needs_profile", "miss_costs")


#: colours of figures for a policy that declares none (picked by its name, so stable across runs)
_SPARE_COLOURS = ("tab:olive", "tab:brown", "goldenrod", "teal", "navy", "maroon", "darkkhaki", "slateblue")


def policy_colour(name: str) -> str:
    """The colour of policy ``name`` in figures: its declared ``colour``, else one of ``_SPARE_COLOURS`` chosen by
    the name (a registered policy without a colour, or a row of a policy not registered in this process)."""
    import zlib

    s = SPECS.get(name)
    if s is not None and s.colour is not None:
        return s.colour
    return _SPARE_COLOURS[zlib.crc32(str(name).encode()) % len(_SPARE_COLOURS)]


def policies() -> tuple[str, ...]:
    """The names of every registered policy, in registration order."""
    return tuple(SPECS)


def spec(name: str) -> PolicySpec:
    """The registered policy ``name``; an unknown name raises ValueError listing the known ones."""
    s = SPECS.get(name) if isinstance(name, str) else None
    if s is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(SPECS)}")
    return s


def _check(s: PolicySpec) -> None:
    """ValueError naming the first field of ``s`` that cannot be registered."""
    if not isinstance(s, PolicySpec):
        raise ValueError(f"register_policy takes a PolicySpec, got {type(s).__name__}")
    check_name(s.name, "policy")
    if s.name in SPECS:
        raise ValueError(f"routing policy {s.name!r} is already registered")
    if s.code is None:
        raise ValueError(f"policy {s.name!r}: code None is original top-K or pruning (ranked in torch); a registered "
                         f"policy needs a kernel code, one of {sorted(KERNEL_CODES)}")
    if isinstance(s.code, bool) or not isinstance(s.code, int) or s.code not in KERNEL_CODES:
        raise ValueError(f"policy {s.name!r}: kernel code {s.code!r} has no key rule in routing/kernels.py: "
                         f"token_keys (known codes {sorted(KERNEL_CODES)})")
    strength, reads = KERNEL_CODES[s.code]
    if s.strength != strength:
        raise ValueError(f"policy {s.name!r}: kernel code {s.code} reads the strength {strength!r}, not {s.strength!r}")
    for flag in _FLAGS:
        value = getattr(s, flag)
        if not isinstance(value, bool):
            raise ValueError(f"policy {s.name!r}: {flag} must be True or False, got {value!r}")
        if value != (flag in reads):
            raise ValueError(f"policy {s.name!r}: {flag} must be {flag in reads} for kernel code {s.code} (its key "
                             f"rule reads {', '.join(reads) or 'none of ' + ', '.join(_FLAGS)})")
    if isinstance(s.top_j, bool) or not isinstance(s.top_j, int) or s.top_j < 0:
        raise ValueError(f"policy {s.name!r}: top_j must be a whole number ≥ 0, got {s.top_j!r}")
    if s.steer is not None:
        ok = (isinstance(s.steer, tuple) and len(s.steer) == 3
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in s.steer))
        if not ok or not 0 < s.steer[0] <= s.steer[2] <= s.steer[1]:
            raise ValueError(f"policy {s.name!r}: steer must be (s_min, s_max, s0) with 0 < s_min ≤ s0 ≤ s_max, "
                             f"got {s.steer!r}")
        if s.strength == "m":
            raise ValueError(f"policy {s.name!r}: a whole-number strength (m) cannot be steered")
        high = STRENGTH_RANGES.get(s.strength, (0.0, None))[1]
        if high is not None and s.steer[1] > high:
            raise ValueError(f"policy {s.name!r}: steer's s_max {s.steer[1]} exceeds {s.strength}'s range "
                             f"[{STRENGTH_RANGES[s.strength][0]:g}, {high:g}]")
    if s.colour is not None and not isinstance(s.colour, str):
        raise ValueError(f"policy {s.name!r}: colour must be a matplotlib colour name or None, got {s.colour!r}")


def register_policy(s: PolicySpec) -> PolicySpec:
    """Add the routing policy ``s``: from now on every entry point accepts ``s.name`` (``RoutingConfig``, the
    kernel's dispatch, ``--policy`` and sweep's ``--policies``, sweep grids, bench, lm-eval's ``policy=``, the live
    view, the controller when ``s.steer`` is set, report colours). ValueError, before anything changes, for a
    name already registered, a code without a key rule in ``codes.KERNEL_CODES``, or flags / a strength that
    contradict what that rule reads. Returns ``s``."""
    _check(s)
    SPECS[s.name] = s
    return s


def unregister_policy(name: str) -> None:
    """Remove a policy added with :func:`register_policy` (the built-in ones stay)."""
    unregister(SPECS, BUILTIN, name, "routing policy", spec)


def registered_policy(s: PolicySpec):
    """``with registered_policy(PolicySpec(...)):`` the policy exists inside the block only (tests)."""
    return registered(register_policy, SPECS, s)

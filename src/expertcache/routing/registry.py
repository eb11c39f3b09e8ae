"""The routing-policy registry: every policy declared once, as a :class:`PolicySpec`, and read by the policy
kernel's dispatch (``kernels.CODES``), :class:`~expertcache.routing.RoutingConfig`, the command-line flags,
sweep grids, bench, the live view, reports' colours and the miss-rate controller.

Plain data, no imports: the kernels (layer 1's lowest module) read it too. Adding a policy: a ``PolicySpec``
here, its key rule in ``kernels.py: token_keys`` under the new ``code``, an oracle in ``tests/oracles.py``
(docs/ARCHITECTURE.md, "Add a routing policy").
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PolicySpec", "SPECS", "POLICIES", "STRENGTH", "DEFAULT_TOP_J", "CACHE_PRIOR", "CODES", "NEEDS_PROBS",
           "STEERABLE", "NEEDS_PROFILE", "spec"]


@dataclass(frozen=True)
class PolicySpec:
    """One routing policy.

    name: the ``--policy`` value. code: its key rule in ``kernels.token_keys`` (None: residency-independent,
    ranked in torch: original top-K, pruning). strength: the :class:`RoutingConfig` field that is its strength
    (0 = original routing; None: no strength). top_j: the top-J it keeps when none is given (001's policies 1,
    003's ERAS 0). running_delta: keys read 001's running Δavg (Eq. 10). needs_probs: keys read the router
    probabilities. needs_profile: needs an activation-frequency profile (ERAS biasing). steer: (s_min, s_max,
    s0) of the miss-rate controller when the policy's strength can be steered to a target, else None.
    colour: its colour in figures."""

    name: str
    code: int | None
    strength: str | None
    top_j: int = 1
    running_delta: bool = False
    needs_probs: bool = False
    needs_profile: bool = False
    steer: tuple[float, float, float] | None = None
    colour: str | None = None


SPECS: dict[str, PolicySpec] = {s.name: s for s in (
    PolicySpec("original", None, None, colour="black"),
    PolicySpec("prune", None, "h", colour="tab:gray"),
    PolicySpec("max-rank", 1, "m", colour="tab:orange"),
    PolicySpec("cumsum", 3, "p", needs_probs=True, colour="tab:green"),
    PolicySpec("cache-prior", 0, "lam", running_delta=True, steer=(1e-3, 1.0, 0.2), colour="tab:purple"),
    PolicySpec("eras-threshold", 4, "alpha", top_j=0, needs_probs=True, colour="tab:blue"),
    PolicySpec("eras-bias", 2, "beta", top_j=0, needs_profile=True, steer=(1e-3, 8.0, 1.0), colour="tab:cyan"),
    PolicySpec("cache-prior-cost", 5, "lam", running_delta=True, colour="tab:pink"),
)}

POLICIES = tuple(SPECS)
#: which hyper-parameter is a policy's strength (0 = original routing), for sweeps and reports
STRENGTH = {s.name: s.strength for s in SPECS.values()}
#: top-J each policy uses when none is given
DEFAULT_TOP_J = {s.name: s.top_j for s in SPECS.values()}
#: Cache-Prior and its cost-aware variant (λ, running Δavg)
CACHE_PRIOR = tuple(s.name for s in SPECS.values() if s.running_delta)
#: policy -> kernel code
CODES = {s.name: s.code for s in SPECS.values() if s.code is not None}
#: policies whose keys read the router probabilities
NEEDS_PROBS = tuple(s.name for s in SPECS.values() if s.needs_probs)
#: policies the miss-rate controller can steer -> (s_min, s_max, s0)
STEERABLE = {s.name: s.steer for s in SPECS.values() if s.steer is not None}
#: policies that need an activation-frequency profile
NEEDS_PROFILE = tuple(s.name for s in SPECS.values() if s.needs_profile)


def spec(name: str) -> PolicySpec:
    """The registered policy ``name``; an unknown name raises ValueError listing the known ones."""
    s = SPECS.get(name)
    if s is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return s

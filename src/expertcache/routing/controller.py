"""Budget-targeted routing: an online per-layer controller that sets a policy's strength so that the running
miss rate stays at a target (pure Python: no torch, no numpy).

The user's question is the inverse of the papers': not "λ = 0.3 gives which miss rate?" but "I can afford a
miss rate of 10 % -- route so". :class:`MissRateController` keeps one strength per MoE layer and updates it
after every (token, layer) from that token's misses at that layer:

    e_t      = (misses_t / K - target) / target      (this token's relative error at this layer)
    I_t      = I_{t-1} + e_t                        (integral = t · (running miss rate - target))
    E_t      = (1 - a) E_{t-1} + a e_t               (smoothed error, a = ``smoothing``)
    log s_t  = log s0 + kp · E_t + ki · I_t, clipped to [log s_min, log s_max]

The controller acts on log s (a strength scales the bias additively in logit units, so equal log steps change
the miss rate by comparable amounts at any strength). The integral term drives the *cumulative* miss rate to
the target (it is t · (running miss rate / target - 1)), so cold-start misses of the first tokens are paid back
later; anti-windup: a step that would push a clipped strength further out is not integrated. A target below
what the strongest setting reaches (or above what the original routing gives) saturates at ``s_max`` /
``s_min`` and :attr:`MissRateController.saturated` says so.

Strengths are quantised to ``levels`` log-spaced values (plus s_min) so that a router can keep one prepared
policy per level (:class:`expertcache.routing.budget.BudgetRouter`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from expertcache.routing.registry import SPECS, STEERABLE

__all__ = ["ControllerConfig", "MissRateController", "DEFAULT_RANGE"]

#: (s_min, s_max, s0) per policy: Cache-Prior λ ∈ [0, 1]; ERAS-bias β ≥ 0 (penalty in logit units).
DEFAULT_RANGE = STEERABLE  # declared per policy in routing/registry.py (PolicySpec.steer)


@dataclass(frozen=True)
class ControllerConfig:
    """target: miss rate in (0, 1). s_min / s_max: strength range (s_min ≈ original routing). s0: initial
    strength (one value, or per layer; calibrate it with
    :func:`expertcache.eval.budget.calibrate_strength` -- the default gains assume a calibrated start; from an
    uncalibrated one, ki = 0.1 converges faster at some cost in perplexity). ki, kp: integral and proportional
    gains on log s (kp > 0 reacts faster but jitters the strength, which costs perplexity). smoothing: EMA
    factor of the proportional error. levels: quantisation of the strength range. per_layer: one controlled
    strength per layer, each driving its layer's miss rate to the target (fails where a layer's miss rate under
    the original routing is already below the target); default: one strength for all layers, driven by the
    whole-model miss rate (every (token, layer) update counts 1/L)."""

    target: float
    s_min: float = 1e-3
    s_max: float = 1.0
    s0: float | tuple[float, ...] = 0.2
    ki: float = 0.03
    kp: float = 0.0
    smoothing: float = 0.05
    levels: int = 96
    per_layer: bool = False
    decay: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.target, (int, float)) and 0.0 < self.target < 1.0):
            raise ValueError(f"target miss rate must be in (0, 1), got {self.target!r}")
        if not 0.0 < self.s_min < self.s_max or not math.isfinite(self.s_max):
            raise ValueError(f"strength range must satisfy 0 < s_min < s_max < inf, got [{self.s_min}, {self.s_max}]")
        s0 = self.s0 if isinstance(self.s0, tuple) else (self.s0,)
        for s in s0:
            if not self.s_min <= s <= self.s_max:
                raise ValueError(f"initial strength {s} outside [{self.s_min}, {self.s_max}]")
        if self.ki < 0 or self.kp < 0 or not 0.0 < self.smoothing <= 1.0 or self.levels < 2:
            raise ValueError("gains must be ≥ 0, smoothing in (0, 1], levels ≥ 2")

    @classmethod
    def for_policy(cls, policy: str, target: float, **kw) -> "ControllerConfig":
        if policy not in DEFAULT_RANGE:
            raise ValueError(f"--target-miss-rate controls {' or '.join(f'{p} ({SPECS[p].strength})' for p in DEFAULT_RANGE)}, "
                             f"not {policy!r}")
        s_min, s_max, s0 = DEFAULT_RANGE[policy]
        return cls(target=target, **{"s_min": s_min, "s_max": s_max, "s0": s0, **kw})


@dataclass
class _Layer:
    base: float  # log s0
    integral: float = 0.0
    smooth: float = 0.0
    log_s: float = 0.0
    tokens: int = 0
    misses: int = 0
    history: list = field(default_factory=list)  # strength after each token (if recorded)
    miss_history: list = field(default_factory=list)  # misses of each token (if recorded)


class MissRateController:
    """Per-layer PI controller of a routing strength (see the module docstring). ``k`` = experts per token."""

    def __init__(self, config: ControllerConfig, num_layers: int, k: int, *, record: bool = False) -> None:
        if num_layers < 1 or k < 1:
            raise ValueError(f"need ≥ 1 layer and K ≥ 1, got L={num_layers}, K={k}")
        self.config, self.k, self.record = config, k, record
        s0 = config.s0 if isinstance(config.s0, tuple) else (config.s0,) * num_layers
        if len(s0) != num_layers:
            raise ValueError(f"{len(s0)} initial strengths for {num_layers} layers")
        self._lo, self._hi = math.log(config.s_min), math.log(config.s_max)
        self.layers = [_Layer(base=math.log(s), log_s=math.log(s)) for s in s0]  # counters (+ control if per layer)
        # control state: per layer, or one shared (started at the mean initial log strength)
        self._ctl = self.layers if config.per_layer else \
            [_Layer(base=sum(x.base for x in self.layers) / num_layers)]
        self._ctl[0].log_s = self._ctl[0].base
        self._scale = 1.0 if config.per_layer else 1.0 / num_layers
        self._step = (self._hi - self._lo) / (config.levels - 1)

    # -- reading ----------------------------------------------------------------------------------

    def strength(self, layer: int) -> float:
        """The strength of ``layer`` now, quantised (see :meth:`level`)."""
        return self.level_value(self.level(layer))

    def level(self, layer: int) -> int:
        """Index of the quantised strength of ``layer`` in 0 .. levels - 1."""
        x = (self._ctl[layer if self.config.per_layer else 0].log_s - self._lo) / self._step
        return max(0, min(self.config.levels - 1, int(round(x))))

    def level_value(self, level: int) -> float:
        return math.exp(self._lo + level * self._step)

    def strengths(self) -> list[float]:
        return [self.strength(i) for i in range(len(self.layers))]

    def miss_rate(self, layer: int | None = None) -> float:
        """Running (cumulative) miss rate of one layer or of all layers, as the controller saw it."""
        ls = self.layers if layer is None else [self.layers[layer]]
        slots = sum(x.tokens for x in ls) * self.k
        return sum(x.misses for x in ls) / slots if slots else 0.0

    @property
    def saturated(self) -> list[str | None]:
        """Per layer: 'max' / 'min' when the strength sits at a bound of its range, else None."""
        out = []
        for i in range(len(self.layers)):
            lv = self.level(i)
            out.append("max" if lv == self.config.levels - 1 else "min" if lv == 0 else None)
        return out

    # -- updating -----------------------------------------------------------------------------------

    def update(self, layer: int, misses: int) -> None:
        """One token was served at ``layer`` with ``misses`` misses (0..K): update that layer's strength."""
        c, counter = self.config, self.layers[layer]
        counter.tokens += 1
        counter.misses += misses
        x = self._ctl[layer if c.per_layer else 0]
        e = (misses / self.k - c.target) / c.target
        x.smooth += c.smoothing * self._scale * (e - x.smooth)
        gain = 1.0 if c.decay <= 0 else math.sqrt(c.decay / (c.decay + counter.tokens))
        integral = x.integral + self._scale * gain * e
        u = x.base + c.kp * x.smooth + c.ki * integral
        if (u > self._hi and e > 0) or (u < self._lo and e < 0):  # anti-windup: do not integrate further out
            integral = x.integral
            u = x.base + c.kp * x.smooth + c.ki * integral
        x.integral = integral
        x.log_s = min(self._hi, max(self._lo, u))
        if self.record:
            counter.history.append(self.strength(layer))
            counter.miss_history.append(misses)

    def state(self) -> dict:
        """JSON-able summary: target, per-layer strengths, miss rates, saturation."""
        return dict(target=self.config.target, strengths=self.strengths(), miss_rate=self.miss_rate(),
                    layer_miss_rates=[self.miss_rate(i) for i in range(len(self.layers))],
                    saturated=self.saturated, tokens=self.layers[0].tokens)

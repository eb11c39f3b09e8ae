"""The open-loop cache simulator (``simulate``), fixed-selection replay (``replay``) and activation profiles."""

from expertcache.sim.simulator import SimResult, activation_frequency, replay, simulate

__all__ = ["SimResult", "activation_frequency", "replay", "simulate"]

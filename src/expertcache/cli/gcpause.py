"""Python's cyclic garbage collector paused while a command starts (imports, loading, the first token).

A start creates hundreds of thousands of objects that all live on (modules, classes, the model's modules and
tensors); every 700 allocations the collector scans the young ones, and every so often all of them: measured
~1,180 collections, 0.9-1.0 s of a 4.7 s second start of ``generate --quant int4 --quant-dense int8`` on a
2-layer OLMoE-1B-7B shape. :class:`GCPause` disables the collector for the start and restores the state it
found when the start is over (:meth:`GCPause.resume`, :func:`resume_gc`: ``generate`` at its first token) or when
the block ends, exception or not; ``freeze``: the objects made meanwhile go to the permanent generation
(``gc.freeze``), out of later collections' scans (for a process that ends with the command: garbage cycles made
during the start are then never freed)."""

from __future__ import annotations

import gc

__all__ = ["GCPause", "resume_gc"]

_ACTIVE: list["GCPause"] = []  # the pauses entered and not resumed, innermost last


class GCPause:
    """``with GCPause():`` the collector disabled until :meth:`resume` or the block's end (whichever is first),
    then enabled again only if it was enabled on entry (a pause inside another does not end the outer one)."""

    def __init__(self, *, freeze: bool = False) -> None:
        self.freeze = freeze
        self.was_enabled = False
        self.resumed = True  # not entered yet

    def __enter__(self) -> "GCPause":
        self.was_enabled, self.resumed = gc.isenabled(), False
        gc.disable()
        _ACTIVE.append(self)
        return self

    def resume(self) -> None:
        """End the pause now (idempotent): freeze what exists (``freeze``), then the collector as it was."""
        if self.resumed:
            return
        self.resumed = True
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self.freeze:
            gc.freeze()
        if self.was_enabled:
            gc.enable()

    def __exit__(self, *exc) -> bool:
        self.resume()
        return False


def resume_gc() -> None:
    """End the innermost active :class:`GCPause` (a command's start is over); nothing when none is active."""
    if _ACTIVE:
        _ACTIVE[-1].resume()

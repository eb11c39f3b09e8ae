"""The demo routing trace shipped inside the package (recorded from the shipped default model)."""

from __future__ import annotations

from pathlib import Path

DEMO_TRACE_NAME = "granular-wikitext2.trace.safetensors"


def demo_trace_path() -> Path:
    """Path of the shipped demo trace; FileNotFoundError with a hint when it is missing."""
    path = Path(__file__).resolve().parent.parent / "assets" / "traces" / DEMO_TRACE_NAME
    if not path.exists():
        raise FileNotFoundError(
            f"the demo trace {path} is not installed; pass a trace file, or record one with "
            "`expertcache trace record`")
    return path

"""Shared checks for figure tests: a written PNG must show data, not just an empty frame.

``record_figures()`` captures, for every figure saved while it is active, how much data its axes hold (points of
lines and scatter collections, image pixels, bars); ``ink_fractions`` measures the PNG itself."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np


def data_points(fig) -> dict:
    """{'axes', 'points', 'image_pixels', 'patches'} of the data artists on ``fig``'s axes (legends excluded)."""
    points = pixels = patches = 0
    for ax in fig.axes:
        for line in ax.lines:
            x = np.asarray(line.get_xdata(), dtype=float)
            points += int(np.isfinite(x).sum())
        for coll in ax.collections:
            offsets = coll.get_offsets()
            n_off = 0 if offsets is None else len(offsets)
            points += n_off if n_off > 1 else sum(len(p.vertices) for p in coll.get_paths())
        for im in ax.images:
            pixels += int(np.asarray(im.get_array()).size)
        patches += sum(1 for p in ax.patches if p.get_visible())
    return {"axes": len(fig.axes), "points": points, "image_pixels": pixels, "patches": patches}


@contextlib.contextmanager
def record_figures():
    """Yield a dict {file name: data_points(fig)} filled by every ``Figure.savefig`` call inside the block."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seen: dict[str, dict] = {}
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        name = Path(str(fname)).name  # expertcache.results.save_figure writes ".<name>.<random>.expertcache-tmp"
        seen[name[1:].rsplit(".", 2)[0] if name.endswith(".expertcache-tmp") else name] = data_points(self)
        return original(self, fname, *args, **kwargs)

    Figure.savefig = savefig
    try:
        yield seen
    finally:
        Figure.savefig = original


def ink_fractions(path: str | Path) -> tuple[float, float]:
    """(fraction of pixels that differ from the background colour, fraction that are coloured -- not white, grey or
    black) of a PNG. Axes, ticks and text are black/grey; data is drawn in colour."""
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))
    rgb = img[..., :3].reshape(-1, 3).astype(np.float64)
    if img.shape[-1] == 4:  # composite over white
        a = img[..., 3].reshape(-1, 1)
        rgb = rgb * a + (1 - a)
    colours, counts = np.unique(np.round(rgb, 2), axis=0, return_counts=True)
    background = colours[counts.argmax()]
    ink = np.abs(rgb - background).max(axis=1) > 0.1
    coloured = (rgb.max(axis=1) - rgb.min(axis=1)) > 0.15
    return float(ink.mean()), float(coloured.mean())


def assert_drawn(path: str | Path, recorded: dict | None = None, min_points: int = 2) -> None:
    """``path`` is a PNG with coloured ink on it (an empty matplotlib axes has none) and, when ``recorded`` (from
    :func:`record_figures`) is given, its figure held at least ``min_points`` data points or an image."""
    path = Path(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    ink, colour = ink_fractions(path)
    assert ink > 0.01 and colour > 0.0001, f"{path.name}: only {ink:.2%} ink, {colour:.3%} coloured pixels"
    if recorded is not None:
        stats = recorded[path.name]
        assert stats["axes"] >= 1 and (stats["points"] >= min_points or stats["image_pixels"] > 0
                                       or stats["patches"] >= min_points), f"{path.name}: {stats}"

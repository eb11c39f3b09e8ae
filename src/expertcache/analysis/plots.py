"""Matplotlib figures of the activation profiling (003 Fig. 3, 4, 6). Each function writes one PNG and
returns its path; matplotlib is imported lazily with the non-interactive Agg backend."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from expertcache.results import pyplot, save_figure

__all__ = ["plot_frequency", "plot_correlation", "plot_distinct"]


def _save(fig, path) -> Path:
    return save_figure(fig, path, tight=False, dpi=130, bbox_inches="tight")


def plot_frequency(freq_LE: np.ndarray, path: str | os.PathLike, title: str = "") -> Path:
    """Heatmap [L, E] of the per-layer normalised activation frequency (003 Fig. 3); the colour bar marks
    the uniform share 1/E."""
    plt = pyplot()
    l, e = freq_LE.shape
    fig, ax = plt.subplots(figsize=(max(5.0, 0.22 * e + 2.0), max(2.2, 0.45 * l + 1.2)))
    im = ax.imshow(freq_LE, aspect="auto", cmap="viridis", interpolation="nearest")
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.ax.axhline(1.0 / e, color="white", lw=1.5)
    cb.set_label(f"share of layer's selections\n(white line: uniform 1/E = {1.0 / e:.3f})")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(l))
    ax.set_title(title or "Per-layer activation frequency")
    return _save(fig, path)


def plot_correlation(corr_FF: np.ndarray | None, layer_corr_LL: np.ndarray, num_layers: int,
                     path: str | os.PathLike, title: str = "") -> Path:
    """Left: the (layer, expert) × (layer, expert) Pearson correlation matrix with layer blocks outlined
    (003 Fig. 4; omitted when ``corr_FF`` is None); right: the [L, L] best-match summary."""
    plt = pyplot()
    panels = 2 if corr_FF is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.0 * panels + 1.0, 5.4),
                             gridspec_kw={"width_ratios": [1.6, 1.0]} if panels == 2 else None)
    axes = np.atleast_1d(axes)
    if corr_FF is not None:
        ax = axes[0]
        f = corr_FF.shape[0]
        e = f // num_layers
        cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.8")
        im = ax.imshow(np.ma.masked_invalid(corr_FF), cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
        for b in range(1, num_layers):
            ax.axhline(b * e - 0.5, color="k", lw=0.6)
            ax.axvline(b * e - 0.5, color="k", lw=0.6)
        ticks = [b * e + e / 2 - 0.5 for b in range(num_layers)]
        ax.set_xticks(ticks, [f"L{b}" for b in range(num_layers)])
        ax.set_yticks(ticks, [f"L{b}" for b in range(num_layers)])
        ax.set_title("Pearson r, (layer, expert) pairs across tokens")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    ax = axes[-1]
    im = ax.imshow(layer_corr_LL, cmap="magma", vmin=0, vmax=1, interpolation="nearest")
    for i in range(num_layers):
        for j in range(num_layers):
            v = layer_corr_LL[i, j]
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if v < 0.6 else "black")
    ax.set_xticks(range(num_layers))
    ax.set_yticks(range(num_layers))
    ax.set_xlabel("layer m")
    ax.set_ylabel("layer l")
    ax.set_title("mean over experts of layer l of\nmax |r| with one expert of layer m")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    fig.suptitle(title or "Inter-layer router correlation")
    return _save(fig, path)


def plot_distinct(distinct_BL: np.ndarray, num_experts: int, top_k: int, path: str | os.PathLike,
                  title: str = "", mode: str = "random") -> Path:
    """Distinct experts requested per layer vs batch size (003 Fig. 6), with the b·K bound and the
    independent-uniform-routing expectation."""
    from expertcache.analysis.profiling import uniform_distinct

    plt = pyplot()
    bmax, l = distinct_BL.shape
    b = np.arange(1, bmax + 1)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, l))
    for layer in range(l):
        ax.plot(b, distinct_BL[:, layer], marker="o", ms=3, lw=1.2, color=colors[layer], label=f"layer {layer}")
    ax.plot(b, np.minimum(num_experts, top_k * b), "k:", lw=1, label="b·K (no overlap)")
    ax.plot(b, uniform_distinct(num_experts, top_k, bmax), "k--", lw=1, label="uniform independent")
    ax.axhline(num_experts, color="0.6", lw=0.8)
    ax.set_xlabel(f"batch size b ({mode} tokens)")
    ax.set_ylabel("distinct experts requested per layer")
    ax.set_ylim(0, num_experts * 1.05)
    ax.set_xlim(1, bmax)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    ax.set_title(title or "Distinct experts vs batch size")
    return _save(fig, path)

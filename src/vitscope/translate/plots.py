"""The lecture's picture: source words along one axis, target words along the other, each target word's
attention over the source as a row of the heatmap, the gold alignment marked, so the reordering shows.

The functions return matplotlib Figures built directly (no pyplot), which show inline in a notebook and save
anywhere; `path=` also writes a PNG.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vitscope.figures import Figure


def alignment_figure(source: Sequence[str], target: Sequence[str], attention: Tensor | np.ndarray, *,
                     gold: Sequence[int] | None = None, title: str = "", path: str | Path | None = None) -> Figure:
    """attention (T, N): row t is target word t's attention over the N source words. Gold positions, where
    given, are outlined; a cell whose attention peaks on its gold word is outlined in cyan, else in red."""
    att = torch.as_tensor(attention).detach().float().cpu().numpy()[: len(target), : len(source)]
    fig = Figure(figsize=(1.2 + 0.42 * len(source), 1.2 + 0.36 * len(target)), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(att, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.xaxis.tick_top()  # read like the lecture's figure: the source along the top
    ax.xaxis.set_label_position("top")
    ax.set_xticks(range(len(source)), list(source), rotation=60, ha="left")
    ax.set_yticks(range(len(target)), list(target))
    ax.set_xlabel("source words")
    ax.set_ylabel("target words (written top to bottom)")
    if gold is not None:
        peaks = att.argmax(1)
        for t, g in enumerate(list(gold)[: len(target)]):
            if g < 0:
                continue
            color = "#00e5ff" if peaks[t] == g else "#ff3030"
            ax.add_patch(_box(g, t, color))
    if title:
        ax.set_title(title, fontsize=10, pad=8)
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="attention")
    if path is not None:
        fig.save(path)
    return fig


def _box(x: int, y: int, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor=color, linewidth=1.6)


def accuracy_by_length_figure(curves: dict[str, dict[int, tuple[float, int]]], *, title: str = "",
                              path: str | Path | None = None) -> Figure:
    """Exact sentence accuracy against source length, one line per model: curves[name] = {length: (accuracy,
    sentences)}. Lengths with fewer than 5 test sentences are left out (their accuracy is noise)."""
    fig = Figure(figsize=(7, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    for name, by_length in curves.items():
        xs = [n for n, (_, count) in sorted(by_length.items()) if count >= 5]
        ax.plot(xs, [100 * by_length[n][0] for n in xs], marker="o", label=name)
    ax.set_xlabel("source sentence length (words)")
    ax.set_ylabel("exact sentence accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    if title:
        ax.set_title(title, fontsize=10)
    if path is not None:
        fig.save(path)
    return fig

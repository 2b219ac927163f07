"""vitscope's pictures: matplotlib figures drawn without pyplot, which show themselves in Jupyter.

    fig = plot_regions(stats)                  # in a notebook cell: the picture, inline
    fig = plot_regions(stats, "regions.png")   # the same figure, also written to a file (atomically)

A `Figure` is matplotlib's own, made directly rather than through pyplot: no backend is switched (importing a
plotting module leaves a notebook's inline backend alone), no global figure list grows, nothing is shown
twice. Jupyter draws a figure through the formatter that pyplot's inline backend installs; where pyplot was
never imported there is none, so the figure offers its PNG itself (`_repr_png_`).
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib.figure

from vitscope.io import PathLike, save_figure


class Figure(matplotlib.figure.Figure):
    """matplotlib's `Figure`, which Jupyter also shows when pyplot was never imported."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()

    def save(self, path: PathLike, **savefig_kw) -> Path:
        """Write the figure to `path` whole (format from its suffix): `vitscope.io.save_figure`."""
        return save_figure(self, path, **savefig_kw)

"""Attention over training: what a run's probes kept, read back, drawn side by side and explored with a slider.

A training run keeps, at every evaluation (and at step 0, before the first step), the attention of a few fixed
inputs in `probes.safetensors` beside its metrics (vitscope.training.probes writes it):

    translate  a few test sentences, teacher-forced on their reference: attention (K, T, N), or (K, T, L, H, N)
               for a transformer, row t for the step that wrote target word t
    caption    a few test scenes, teacher-forced on a reference caption: cross-attention (K, T, L, H, N) for the
               transformer, the LSTM's alignment (K, T, N); N the image's tokens, prefix tokens first
    classify   a few test images: each layer's class-token attention over the patches (K, L, H, P) (the mean
               attention each patch receives where the model has no class token) and each head's mean
               attention distance (L, H), as the ViT paper's Figure 7 measures it (vitscope.inspect.stats)

    probes = read_probes("runs/translate_rnn")    # or the .safetensors file itself
    probes.steps                                  # [0, 120, 240, ...]
    probes.attention(step)                        # the tensor kept at that step
    probes_figure(probes)                         # the alignment at a few steps, side by side (a Figure)

The explorers (explorer.html, captions.html, translations.html) show the same views under "Over training", a
slider over the steps; `probes_page(probes)` is that section alone (vitscope.inspect.probes_page).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open
from torch import Tensor

from vitscope.errors import InputError
from vitscope.figures import Figure
from vitscope.inspect.plots import overlay

FILE = "probes.safetensors"
FORMAT = "vitscope.probes/1"


@dataclass
class Probes:
    """A run's probes: `kind` (translate, caption, classify), `inputs` (what was probed: sentences, captions,
    class names), `images` (K, C, H, W) uint8 for caption and classify, and per step its tensors."""

    kind: str
    inputs: list[dict]
    steps: list[int]
    epochs: list[float]
    tensors: dict[int, dict[str, Tensor]] = field(repr=False)
    images: Tensor | None = field(default=None, repr=False)
    grid: tuple[int, int] | None = None  # the image tokens' grid (caption, classify)
    num_prefix_tokens: int = 0

    def attention(self, step: int) -> Tensor:
        return self.tensors[step]["attention"].float()

    def distance(self, step: int) -> Tensor | None:
        t = self.tensors[step].get("distance")
        return None if t is None else t.float()

    def spread(self, count: int = 4) -> list[int]:
        """`count` steps spread over the run: the first, the last and evenly between."""
        if len(self.steps) <= count:
            return list(self.steps)
        picks = np.linspace(0, len(self.steps) - 1, count).round().astype(int)
        return [self.steps[i] for i in dict.fromkeys(picks.tolist())]


def read_probes(source: str | Path) -> Probes:
    """A run directory's probes (its probes.safetensors, or that file given directly); InputError when there are
    none or the file is damaged."""
    path = Path(source)
    if path.is_dir():
        path = path / FILE
    if not path.is_file():
        raise InputError(f"{path}: no probes; a run keeps them from vitscope 0.1 on (vitscope train writes "
                         f"{FILE} beside metrics.jsonl)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        header = json.loads(meta.get("probes", "null"))
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable probes file ({e}); the file is damaged") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise InputError(f"{path}: not a vitscope probes file (want format {FORMAT!r} in its metadata 'probes')")
    by_step: dict[int, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        head, _, name = key.partition("/")
        if head.startswith("step"):
            by_step.setdefault(int(head[4:]), {})[name] = t
    steps = sorted(by_step)
    epochs = [header["epochs"].get(str(s), s) for s in steps]
    grid = tuple(header["grid"]) if header.get("grid") else None
    return Probes(header["kind"], header["inputs"], steps, epochs, by_step, tensors.get("inputs/images"), grid,
                  int(header.get("num_prefix_tokens", 0)))


def run_probes(run_dir: str | Path) -> Probes | None:
    """The probes of the run in `run_dir`, None where it kept none (a damaged file is still an InputError)."""
    return read_probes(run_dir) if (Path(run_dir) / FILE).is_file() else None


# -- what one step's attention shows --------------------------------------------------------------------------
def heads_mean(att: Tensor) -> Tensor:
    """(T, L, H, N) -> (T, N): the last layer's heads averaged; (T, N) as it is."""
    return att[:, -1].mean(1) if att.ndim == 4 else att


def _patch_map(row: Tensor, grid: tuple[int, int], prefix: int) -> Tensor:
    """One attention row over an image's tokens (N,) -> its patches as a (gh, gw) map."""
    return row[prefix:].reshape(grid)


def _translate_panel(ax, probes: Probes, step: int, index: int) -> None:
    item = probes.inputs[index]
    src, tgt = item["source"], item["target"]
    att = heads_mean(probes.attention(step)[index])[: len(tgt), : len(src)]
    ax.imshow(att.numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(src)), src, rotation=90, fontsize=7)
    ax.set_yticks(range(len(tgt)), tgt, fontsize=7)


def probes_figure(probes: Probes, *, steps: Sequence[int] | None = None, index: int = 0, words: int = 6,
                  path: str | Path | None = None) -> Figure:
    """The attention of probe `index` at a few `steps` (default: four spread over the run), side by side, from
    left to right as training went: a translation's alignment heatmap; a caption's first `words` words, each
    its map over the image (rows: steps); a classifier's class-token map over each probed image (rows: steps)
    with each layer's mean attention distance over training beside them."""
    steps = list(steps) if steps is not None else probes.spread()
    missing = [s for s in steps if s not in probes.tensors]
    if missing:
        raise InputError(f"no probes at step {missing[0]}; the run kept steps {probes.steps}")
    if probes.kind == "translate":
        fig = Figure(figsize=(3.2 * len(steps), 3.6), layout="constrained")
        axes = fig.subplots(1, len(steps), squeeze=False)[0]
        for ax, s in zip(axes, steps):
            _translate_panel(ax, probes, s, index)
            ax.set_title(f"step {s} (epoch {_epoch(probes, s)})", fontsize=9)
        fig.suptitle("the alignment emerging: attention of each target word (rows) over the source (columns)",
                     fontsize=10)
    elif probes.kind == "caption":
        item = probes.inputs[index]
        shown = item["words"][:words]
        fig = Figure(figsize=(1.7 * len(shown), 1.8 * len(steps)), layout="constrained")
        axes = fig.subplots(len(steps), len(shown), squeeze=False)
        for r, s in enumerate(steps):
            att = heads_mean(probes.attention(s)[index])
            for c, word in enumerate(shown):
                overlay(axes[r, c], probes.images[index], _patch_map(att[c], probes.grid, probes.num_prefix_tokens),
                        title=word if r == 0 else None)
            axes[r, 0].set_ylabel(f"step {s}", fontsize=9)
        fig.suptitle(f"where each word of \"{' '.join(item['words'])}\" looks, as training goes on", fontsize=10)
    elif probes.kind == "classify":
        k = len(probes.inputs)
        fig = Figure(figsize=(1.8 * k + 3.4, 1.8 * len(steps)), layout="constrained")
        grid = fig.add_gridspec(len(steps), k + 2)
        for r, s in enumerate(steps):
            maps = probes.attention(s)[:, -1].mean(1)  # (K, P): the last layer, heads averaged
            for c in range(k):
                ax = fig.add_subplot(grid[r, c])
                overlay(ax, probes.images[c], maps[c].reshape(probes.grid),
                        title=probes.inputs[c]["label"] if r == 0 else None)
                if c == 0:
                    ax.set_ylabel(f"step {s}", fontsize=9)
        ax = fig.add_subplot(grid[:, k:])
        dist = torch.stack([probes.distance(s) for s in probes.steps])  # (S, L, H)
        for layer in range(dist.shape[1]):
            ax.plot(probes.steps, dist[:, layer].mean(-1).numpy(), marker=".", label=f"layer {layer}")
        ax.set_xlabel("step")
        ax.set_ylabel("mean attention distance (pixels)")
        ax.legend(fontsize=7)
        ax.set_title("each layer's heads, averaged", fontsize=9)
        what = "class-token attention" if probes.num_prefix_tokens else "attention each patch receives (mean)"
        fig.suptitle(f"the last layer's {what} as training goes on", fontsize=10)
    else:
        raise InputError(f"probes of an unknown kind {probes.kind!r}")
    if path is not None:
        fig.save(path, dpi=110, bbox_inches="tight")
    return fig


def _epoch(probes: Probes, step: int) -> str:
    e = probes.epochs[probes.steps.index(step)]
    return f"{e:g}" if isinstance(e, (int, float)) else str(e)

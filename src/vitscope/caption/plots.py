"""The lecture's captioning figure: the image, then one panel per generated word showing where that
word looked. For the transformer, a layer's (or the mean of all layers') cross-attention, one head
or the mean of heads; for the LSTM, its alignment map.

    decoded = beam_search(model, normalize(images, mean, std), beam=5)
    plot_caption_attention(images[0], decoded.words(vocab)[0], decoded.attention[0], grid=model.grid,
                           num_prefix_tokens=model.num_prefix_tokens, path="caption.png")

`explore_captions` captions images into the explorer's caption page (vitscope.inspect.caption_explorer), which a
notebook shows inline; `write_caption_explorer` writes it to a file.

Figures are matplotlib's, drawn without pyplot (no backend switched, no global state): `vitscope.figures.Figure`,
which a notebook shows inline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from vitscope.data import normalize
from vitscope.figures import Figure
from vitscope.inspect.caption_explorer import caption_explorer_data, caption_page
from vitscope.inspect.page import Page
from vitscope.inspect.probes import Probes
from vitscope.sequence.decoding import beam_search, decode, greedy
from vitscope.sequence.vocab import Vocabulary


def word_maps(attention: Tensor, grid: tuple[int, int], *, num_prefix_tokens: int = 0,
              layer: int | str = "mean", head: int | str = "mean") -> Tensor:
    """Per-word maps over the patch grid: attention (T, N) or (T, L, H, N) -> (T, gh, gw).

    `layer` and `head` pick one (an index) or average ("mean"); prefix tokens (CLS) are dropped, so
    a map shows only what fell on the image's patches (its sum is the share of attention they got).
    """
    att = attention.float()
    if att.ndim == 4:  # (T, L, H, N)
        att = att.mean(1) if layer == "mean" else att[:, int(layer)]
        att = att.mean(1) if head == "mean" else att[:, int(head)]
    elif att.ndim != 2:
        raise ValueError(f"attention must be (T, N) or (T, L, H, N), got {tuple(attention.shape)}")
    gh, gw = grid
    patches = att[:, num_prefix_tokens:]
    if patches.shape[1] != gh * gw:
        raise ValueError(f"{patches.shape[1]} image tokens after {num_prefix_tokens} prefix tokens do not "
                         f"fill a {gh} x {gw} grid")
    return rearrange(patches, "t (gh gw) -> t gh gw", gh=gh, gw=gw)


def _display(image: Tensor) -> np.ndarray:
    """(C, H, W) uint8 or float -> (H, W) or (H, W, 3) floats in 0..1 for imshow."""
    x = image.detach().float().cpu()
    if image.dtype == torch.uint8:
        x = x / 255
    else:
        x = (x - x.min()) / (x.max() - x.min()).clamp_min(1e-8)
    return x[0].numpy() if x.shape[0] == 1 else x.permute(1, 2, 0).numpy()


def plot_caption_attention(image: Tensor, words: Sequence[str], attention: Tensor, *, grid: tuple[int, int],
                           num_prefix_tokens: int = 0, layer: int | str = "mean", head: int | str = "mean",
                           references: Sequence[str] = (), columns: int = 6, title: str | None = None,
                           path: str | Path | None = None) -> Figure:
    """One panel per word (and `<eos>`, when the caption has one) with its attention over the image.

    image (C, H, W) as the dataset holds it (uint8) or as the model saw it; words the caption;
    attention its per-step attention, (T, N) or (T, L, H, N), row t for the step that chose word t.
    Each map is upsampled bilinearly to the image and shown on it; its peak is marked.
    """
    words = list(words)
    maps = word_maps(attention, grid, num_prefix_tokens=num_prefix_tokens, layer=layer, head=head)
    labels = words + (["<eos>"] if maps.shape[0] > len(words) else [])
    maps = maps[: len(labels)]
    h, w = image.shape[-2:]
    up = F.interpolate(maps[:, None], size=(h, w), mode="bilinear", align_corners=False)[:, 0]  # (T, H, W)
    shown = _display(image)
    panels = 1 + len(labels)
    cols = min(columns, panels)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(2.1 * cols, 2.5 * rows + 0.5 + 0.3 * bool(references)), dpi=100)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes:
        ax.set_axis_off()
    cmap = "gray" if shown.ndim == 2 else None
    axes[0].imshow(shown, cmap=cmap, vmin=0, vmax=1)
    axes[0].set_title("image", fontsize=10)
    gh, gw = grid
    for i, (label, m) in enumerate(zip(labels, up)):
        ax = axes[i + 1]
        ax.imshow(shown, cmap=cmap, vmin=0, vmax=1)
        ax.imshow(m.numpy(), cmap="inferno", alpha=0.6, vmin=0, vmax=float(m.max()) or 1.0)
        peak = int(maps[i].argmax())
        r, c = divmod(peak, gw)
        ax.plot([(c + 0.5) * w / gw - 0.5], [(r + 0.5) * h / gh - 0.5], marker="+", color="cyan", markersize=8)
        ax.set_title(label, fontsize=11)
    which = "alignment" if attention.ndim == 2 else (
        f"cross-attention, layer {layer}, head {head}".replace("layer mean", "mean of layers")
        .replace("head mean", "mean of heads"))
    fig.suptitle(title or f"{' '.join(words)}\n({which})", fontsize=10)
    if references:
        fig.text(0.01, 0.005, "references: " + " | ".join(references), fontsize=7, wrap=True)
    fig.tight_layout()
    if path is not None:
        fig.save(path)
    return fig


def caption_figure(model, image: Tensor, vocab: Vocabulary, mean: Sequence[float], std: Sequence[float], *,
                   beam: int = 5, path: str | Path | None = None, **kwargs) -> Figure:
    """Caption one uint8 image (C, H, W) with `model` (in eval mode) and draw the figure."""
    x = normalize(image[None], mean, std)
    out = greedy(model, x) if beam == 1 else beam_search(model, x, beam=beam)
    words = out.words(vocab)[0]
    return plot_caption_attention(image, words, out.attention[0][: int(out.lengths[0])], grid=model.grid,
                                  num_prefix_tokens=model.num_prefix_tokens, path=path, **kwargs)


def explore_captions(model, images: Tensor, vocab: Vocabulary, *, mean: Sequence[float], std: Sequence[float],
                     beam: int = 5, max_len: int | None = None, references: Sequence[Sequence[str]] | None = None,
                     names: Sequence[str] | None = None, title: str = "vitscope captions",
                     probes: Probes | None = None) -> Page:
    """Caption uint8 `images` (B, C, H, W) with `model` (eval mode; normalised with the training
    mean/std) into the explorer's caption page, each word with where it looked: a notebook shows it
    inline, `.save(path)` writes it. With a run's `probes` (`read_probes(run_dir)`) the page adds "Over
    training", a slider over the steps the run kept."""
    out = decode(model, normalize(images, mean, std), beam=beam, max_len=max_len)
    attentions = [a[: int(n)] for a, n in zip(out.attention, out.lengths)]
    data = caption_explorer_data(images, out.words(vocab), attentions, grid=tuple(model.grid),
                                 num_prefix_tokens=model.num_prefix_tokens, references=references, names=names,
                                 probes=probes)
    return caption_page(data, title=title)


def write_caption_explorer(model, images: Tensor, vocab: Vocabulary, out_path: str | Path, *,
                           mean: Sequence[float], std: Sequence[float], beam: int = 5, max_len: int | None = None,
                           references: Sequence[Sequence[str]] | None = None, names: Sequence[str] | None = None,
                           title: str = "vitscope captions", probes: Probes | None = None) -> Path:
    """`explore_captions(...)` written to `out_path` (.html)."""
    return explore_captions(model, images, vocab, mean=mean, std=std, beam=beam, max_len=max_len,
                            references=references, names=names, title=title, probes=probes).save(out_path)

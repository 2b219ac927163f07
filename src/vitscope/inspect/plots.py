"""Pictures of what a ViT attends to, as matplotlib figures.

Each `plot_*` function draws one figure and returns it (a `vitscope.figures.Figure`: in a notebook it shows
inline); given a `path`, it also writes the figure there (PNG, atomically). `write_report` writes the
standard set for a model and a batch of images into a folder.

    fig = plot_regions(head_stats(capture_attention(model, images)))   # a notebook shows it
    plot_regions(stats, "regions.png")                                   # and a file holds it
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import torch
from torch import Tensor, nn

from vitscope.figures import Figure
from vitscope.inspect.capture import AttentionCapture, TokenLayout, capture_attention
from vitscope.inspect.images import display_image, model_inputs
from vitscope.inspect.importance import (
    HeadImportance,
    PruningCurve,
    ablation_importance,
    gradient_importance,
    pruning_curve,
)
from vitscope.inspect.rollout import grad_rollout, rollout, rollout_map
from vitscope.inspect.stats import (
    REGION_LABELS,
    REGIONS,
    HeadStats,
    cls_maps,
    head_stats,
    nan_to_none,
    patch_distances,
)

OVERLAY_CMAP = "inferno"


def _show_image(ax, img: np.ndarray) -> None:
    ax.imshow(img, cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def overlay(ax, image: Tensor | np.ndarray, attention: Tensor | np.ndarray, *, alpha: float = 0.6,
            title: str | None = None) -> None:
    """Draw `image` (C, H, W) with the patch map `attention` (h, w) on top, each patch a block."""
    img = display_image(image)
    if isinstance(attention, Tensor):
        attention = attention.detach().float().cpu().numpy()
    amap = np.asarray(attention)
    _show_image(ax, img)
    h, w = img.shape[:2]
    # imshow puts pixel centres on integers, so the image spans -0.5 .. size - 0.5
    extent = (-0.5, w - 0.5, h - 0.5, -0.5)
    # 0 .. max, not min .. max: a nearly uniform map should look nearly uniform
    ax.imshow(amap, cmap=OVERLAY_CMAP, alpha=alpha, extent=extent, interpolation="nearest", vmin=0,
              vmax=max(float(np.nanmax(amap)), 1e-12))
    ax.set_xlim(extent[0], extent[1])
    ax.set_ylim(extent[2], extent[3])
    if title:
        ax.set_title(title, fontsize=9)


def _done(fig: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        fig.save(path, dpi=110, bbox_inches="tight")
    return fig


def _label(i: int, names: Sequence[str] | None) -> str:
    return names[i] if names is not None and i < len(names) else str(i)


def plot_overlays(images: Tensor, capture: AttentionCapture, path: str | Path | None = None, *,
                  grad_maps: Tensor | None = None, predictions: Tensor | None = None,
                  labels: Sequence[int | None] | Tensor | None = None,
                  class_names: Sequence[str] | None = None, max_images: int = 8) -> Figure:
    """One row per image: the image, last-layer CLS attention (mean of heads), rollout, and
    gradient-weighted rollout when `grad_maps` (B, h, w) is given."""
    layout = capture.layout
    n = min(len(images), max_images)
    cls = cls_maps(capture[len(capture) - 1], layout).mean(1)  # (B, h, w)
    roll = rollout_map(rollout(capture.layers(), num_prefix_tokens=layout.num_prefix_tokens), layout)
    first = "CLS attention, last layer" if layout.num_prefix_tokens else "mean patch attention, last layer"
    cols = [(first, cls), ("attention rollout", roll)]
    if grad_maps is not None:
        cols.append(("gradient-weighted rollout", grad_maps))
    aspect = layout.image_size[1] / layout.image_size[0]
    fig = Figure(figsize=(2.3 * aspect * (len(cols) + 1) + 0.5, 2.5 * n + 0.4), layout="constrained")
    axes = fig.subplots(n, len(cols) + 1, squeeze=False)
    for i in range(n):
        head = f"image {i}"
        if predictions is not None:
            head += f"\npred {_label(int(predictions[i]), class_names)}"
        if labels is not None and labels[i] is not None:
            head += f", true {_label(int(labels[i]), class_names)}"
        _show_image(axes[i, 0], display_image(images[i]))
        axes[i, 0].set_title(head, fontsize=9)
        for j, (name, maps) in enumerate(cols, start=1):
            overlay(axes[i, j], images[i], maps[i], title=name if i == 0 else None)
    fig.suptitle("Where the model looks (brighter = more; each map from 0 to its own maximum)", fontsize=10)
    return _done(fig, path)


def plot_heads_grid(image: Tensor, capture: AttentionCapture, path: str | Path | None = None, *,
                    image_index: int = 0, layers: Sequence[int] | None = None) -> Figure:
    """CLS→patch attention of every head (columns) of the chosen layers (rows) for one image."""
    layout = capture.layout
    layers = list(range(len(capture))) if layers is None else list(layers)
    heads = capture[layers[0]].shape[1]
    aspect = layout.image_size[1] / layout.image_size[0]
    size = (1.7 * aspect * heads + 0.6, 1.8 * len(layers) + 0.5)
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(len(layers), heads, squeeze=False)
    for r, layer in enumerate(layers):
        maps = cls_maps(capture[layer], layout)[image_index]  # (H, h, w)
        for h in range(heads):
            ax = axes[r, h]
            overlay(ax, image, maps[h])
            if r == 0:
                ax.set_title(f"head {h}", fontsize=9)
            if h == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=9)
    what = "CLS" if layout.num_prefix_tokens else "mean patch query"
    fig.suptitle(f"{what} → patch attention per head (each map scaled to its own maximum)", fontsize=10)
    return _done(fig, path)


def uniform_distance(layout: TokenLayout) -> float:
    """The mean attention distance of a head that attends uniformly to every patch, in pixels."""
    return float(patch_distances(layout).mean())


def plot_distance(stats: HeadStats, path: str | Path | None = None) -> Figure:
    """Mean attention distance of every head against depth (the ViT paper's Figure 7)."""
    dist = stats.distance
    layers, heads = dist.shape
    fig = Figure(figsize=(max(5.0, 0.45 * layers + 3.5), 3.8), layout="constrained")
    ax = fig.subplots()
    offsets = np.linspace(-0.2, 0.2, heads) if heads > 1 else np.zeros(1)
    colors = matplotlib.colormaps["tab10" if heads <= 10 else "tab20"]
    for h in range(heads):
        ax.scatter(np.arange(layers) + offsets[h], dist[:, h], color=colors(h % colors.N), s=30,
                   edgecolors="k", linewidths=0.4, label=f"head {h}" if heads <= 20 else None, zorder=3)
    uniform = uniform_distance(stats.layout)
    ax.axhline(uniform, ls="--", c="gray", lw=1, label="uniform over patches", zorder=2)
    ax.set_xticks(range(layers))
    ax.set_xlabel("layer")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_ylim(0, 1.1 * max(uniform, float(np.nanmax(dist))))
    ax.set_title("Mean attention distance per head", fontsize=10)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    return _done(fig, path)


def _heatmap(ax, values: np.ndarray, *, title: str, cmap: str, vmin=None, vmax=None, fmt: str = "{:.2f}",
             center: bool = False):
    if center:
        lim = float(np.nanmax(np.abs(values))) or 1.0
        vmin, vmax = -lim, lim
    im = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    layers, heads = values.shape
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    if layers * heads <= 144:
        lo, hi = im.get_clim()
        for (i, j), v in np.ndenumerate(values):
            if np.isfinite(v):
                dark = (v - lo) / max(hi - lo, 1e-12) < 0.5 if not center else abs(v) / max(hi, 1e-12) > 0.5
                ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
    return im


def plot_regions(stats: HeadStats, path: str | Path | None = None) -> Figure:
    """Attention mass in the four regions, per layer and head (each row set sums to 1)."""
    fig = Figure(figsize=(2 * max(3.2, 0.5 * stats.regions.shape[1] + 1.6),
                          2 * max(2.6, 0.38 * stats.regions.shape[0] + 1.2)), layout="constrained")
    axes = fig.subplots(2, 2)
    for ax, name in zip(axes.ravel(), REGIONS):
        values = stats.region(name)
        im = _heatmap(ax, values, title=REGION_LABELS[name], cmap="viridis", vmin=0, vmax=1)
        if np.isnan(values).all():
            ax.text(0.5, 0.5, "the model has no CLS token", transform=ax.transAxes, ha="center", va="center")
    fig.colorbar(im, ax=axes, shrink=0.8, label="share of the row's attention")
    fig.suptitle("The four regions: top, CLS rows; bottom, patch rows (each pair sums to 1)", fontsize=10)
    return _done(fig, path)


def plot_importance(importance: HeadImportance | Sequence[HeadImportance],
                    path: str | Path | None = None) -> Figure:
    """Heat map (layer × head) of each importance measure given."""
    items = [importance] if isinstance(importance, HeadImportance) else list(importance)
    panels = []
    for imp in items:
        if imp.method == "ablation":
            panels.append((imp.delta_loss, f"loss change when removed\n(baseline {imp.base_loss:.3f})",
                           "RdBu_r", "{:+.3f}"))
            panels.append((imp.delta_accuracy * 100, f"accuracy change when removed, points\n"
                           f"(baseline {imp.base_accuracy:.1%})", "RdBu", "{:+.1f}"))
        else:
            panels.append((imp.score, "gradient sensitivity\nmean |∂loss/∂head mask|", "magma", "{:.3f}"))
    layers, heads = items[0].score.shape
    w, h = max(3.6, 0.55 * heads + 2.0), max(3.0, 0.4 * layers + 1.5)
    fig = Figure(figsize=(w * len(panels), h), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (values, title, cmap, fmt) in zip(axes[0], panels):
        im = _heatmap(ax, values, title=title, cmap=cmap, fmt=fmt, center=cmap.startswith("RdBu"))
        fig.colorbar(im, ax=ax, shrink=0.85)
    fig.suptitle("Head importance", fontsize=10)
    return _done(fig, path)


def plot_pruning(curves: dict[str, PruningCurve], path: str | Path | None = None) -> Figure:
    """Accuracy as heads are removed, least important first, for each ranking given."""
    fig = Figure(figsize=(5, 3.5), layout="constrained")
    ax = fig.subplots()
    for name, c in curves.items():
        ax.plot(c.removed, np.asarray(c.accuracy) * 100, marker="o", ms=3, label=name)
    total = len(next(iter(curves.values())).order)
    ax.set_xlabel(f"heads removed (of {total})")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Removing heads, least important first", fontsize=10)
    return _done(fig, path)


def write_report(model: nn.Module, images: Tensor, out_dir: str | Path,
                 labels: Sequence[int | None] | Tensor | None = None,
                 class_names: Sequence[str] | None = None, dataset=None, *,
                 importance: dict[str, HeadImportance] | None = None,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 max_images: int = 8, pruning_steps: int | None = 16) -> list[Path]:
    """Write the standard pictures (and `stats.json`) for `images` (B, C, H, W) into `out_dir`.

    `images` are float tensors as the model takes them, or uint8 with the training `mean`/`std`.
    Head importance and pruning curves need labelled data: `dataset` (a pair of tensors as the model
    takes them, or batches of such) or, failing that, `images` with `labels` (all known).
    `importance` ({"ablation": ..., "gradient": ...}) reuses scores already computed on `dataset`.
    Returns the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images, originals = model_inputs(images, mean, std)
    cap = capture_attention(model, images)
    if cap.layout is None:
        raise ValueError("write_report needs a model with a patch embedding (a ViT or a model holding one)")
    preds = cap.output.argmax(-1) if isinstance(cap.output, Tensor) else None
    grad_maps = rollout_map(grad_rollout(model, images[:max_images]), cap.layout)
    stats = head_stats(cap)
    paths = [out / name for name in ("overlays.png", "heads_last_layer.png", "heads_all_layers.png",
                                     "distance.png", "regions.png")]
    plot_overlays(originals[:max_images], cap, paths[0], grad_maps=grad_maps, predictions=preds, labels=labels,
                  class_names=class_names, max_images=max_images)
    plot_heads_grid(originals[0], cap, paths[1], layers=[len(cap) - 1])
    plot_heads_grid(originals[0], cap, paths[2],
                    layers=np.linspace(0, len(cap) - 1, min(len(cap), 12)).round().astype(int).tolist())
    plot_distance(stats, paths[3])
    plot_regions(stats, paths[4])
    report = {"layout": cap.layout.to_dict(), "stats": stats.to_dict()}
    data = dataset
    if data is None and labels is not None and all(y is not None for y in labels):
        data = (images, torch.as_tensor([int(y) for y in labels]))
    if data is not None:
        importance = importance or {}
        abl = importance.get("ablation") or ablation_importance(model, data)
        grad = importance.get("gradient") or gradient_importance(model, data)
        curves = {f"by {i.method}": pruning_curve(model, data, i, steps=pruning_steps) for i in (abl, grad)}
        plot_importance([abl, grad], out / "importance.png")
        plot_pruning(curves, out / "pruning.png")
        paths += [out / "importance.png", out / "pruning.png"]
        report["importance"] = {"ablation": abl.to_dict(), "gradient": grad.to_dict()}
        report["pruning"] = {k: c.to_dict() for k, c in curves.items()}
    (out / "stats.json").write_text(json.dumps(nan_to_none(report), indent=1, allow_nan=False))
    paths.append(out / "stats.json")
    return paths

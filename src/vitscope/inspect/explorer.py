"""The interactive explorer: one self-contained HTML file (data and code inline, no network).

A person picks an image, a layer and a head (or the mean of heads), hovers a patch to see where it
looks (its row) and what looks at it (its column), switches to the CLS map or to rollout, and reads
the head statistics. Weights travel as base64 float16, (B, L, H, N, N) for the images shown.

    explore(model, images)                               # in a notebook cell: the explorer, inline
    write_explorer(model, images, "explorer.html")       # the same page as a file
    explore(model, images, probes=read_probes(run_dir))  # with "Over training", a slider over the run's steps
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from vitscope.errors import ConfigError
from vitscope.inspect.capture import capture_attention
from vitscope.inspect.explorer_page import BODY, CSS, SCRIPT
from vitscope.inspect.images import model_inputs
from vitscope.inspect.importance import HeadImportance
from vitscope.inspect.page import DEFAULT_MAX_PAGE_BYTES, Page, half_b64, png_data_url, render_page
from vitscope.inspect.probes import Probes
from vitscope.inspect.probes_page import data_bytes, over_training, probes_data
from vitscope.inspect.rollout import rollout
from vitscope.inspect.stats import HeadStats, head_stats, nan_to_none


def explorer_data(model: nn.Module, images: Tensor, *, labels: Sequence[int] | Tensor | None = None,
                  class_names: Sequence[str] | None = None, stats: HeadStats | None = None,
                  importance: HeadImportance | dict[str, HeadImportance] | None = None,
                  image_names: Sequence[str] | None = None, mean: Sequence[float] | None = None,
                  std: Sequence[float] | None = None, top_k: int = 5, probes: Probes | None = None,
                  max_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> dict:
    """Everything the page shows, as JSON-ready data (weights packed as base64 float16); with a run's `probes`,
    the "Over training" section's data too."""
    images, originals = model_inputs(images, mean, std)
    b = images.shape[0]
    cap = capture_attention(model, images)
    if cap.layout is None:
        raise ValueError("the explorer needs a model with a patch embedding (a ViT or a model holding one)")
    layout = cap.layout
    stats = stats or head_stats(cap)
    layers = [cap[n] for n in stats.names]
    weights = torch.stack(layers, dim=1)  # (B, L, H, N, N)
    over = probes_data(probes) if probes is not None else None
    size = weights.numel() * 2 * 4 // 3 + data_bytes(over)
    if size > max_bytes:
        per_image = size // b
        raise ConfigError(f"the explorer would embed {size / 2**20:.1f} MiB of attention weights "
                         f"({per_image / 2**20:.1f} MiB per image, {len(layers)} layers x {weights.shape[2]} "
                         f"heads x {layout.num_tokens}² tokens); pass fewer images or raise max_bytes")
    roll = rollout(layers, num_prefix_tokens=layout.num_prefix_tokens)  # (B, N, N)
    logits = cap.output if isinstance(cap.output, Tensor) else None
    entries = []
    for i in range(b):
        top = []
        if logits is not None and logits.ndim == 2:
            probs = logits[i].float().softmax(-1)
            p, idx = probs.topk(min(top_k, probs.numel()))
            top = [[class_names[j] if class_names and j < len(class_names) else str(j), round(float(v), 5)]
                   for v, j in zip(p.tolist(), idx.tolist())]
        label = None
        if labels is not None and labels[i] is not None:
            y = int(labels[i])
            label = class_names[y] if class_names and y < len(class_names) else str(y)
        entries.append({"src": png_data_url(originals[i]), "top": top, "label": label,
                        "name": image_names[i] if image_names and i < len(image_names) else None})
    if isinstance(importance, HeadImportance):
        importance = {importance.method: importance}
    return {
        "layout": layout.to_dict(),
        "num_layers": len(layers),
        "num_heads": int(weights.shape[2]),
        "names": stats.names,
        "images": entries,
        "weights": half_b64(weights),
        "rollout": half_b64(roll),
        "stats": {k: v for k, v in stats.to_dict().items() if k != "layout"},
        "importance": {k: v.to_dict() for k, v in (importance or {}).items()} or None,
        "probes": over,
    }


def explore(model: nn.Module, images: Tensor, *, labels: Sequence[int] | Tensor | None = None,
            class_names: Sequence[str] | None = None, stats: HeadStats | None = None,
            importance: HeadImportance | dict[str, HeadImportance] | None = None,
            image_names: Sequence[str] | None = None, mean: Sequence[float] | None = None,
            std: Sequence[float] | None = None, title: str = "vitscope explorer", probes: Probes | None = None,
            max_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> Page:
    """The explorer for `images` (B, C, H, W): a `Page` that a notebook shows inline and `.save(path)` writes.

    `images` are float tensors as the model takes them, or uint8 with the training `mean`/`std`
    (drawn then as they are). `stats` and `importance` fill the head table (computed when absent:
    stats always, importance only if given). With a run's `probes` (`read_probes(run_dir)`) the page adds
    "Over training": a slider over the steps the run kept, each step's class-token maps (any layer and head) and
    head distances.
    """
    data = explorer_data(model, images, labels=labels, class_names=class_names, stats=stats,
                         importance=importance, image_names=image_names, mean=mean, std=std,
                         probes=probes, max_bytes=max_bytes)
    css, body, script = over_training(data)
    return Page(render_page(title=title, data=nan_to_none(data), css=CSS + css, body=BODY + body,
                            script=SCRIPT + script), height=1200 if body else 900)


def write_explorer(model: nn.Module, images: Tensor, out_path: str | Path, *,
                   labels: Sequence[int] | Tensor | None = None, class_names: Sequence[str] | None = None,
                   stats: HeadStats | None = None,
                   importance: HeadImportance | dict[str, HeadImportance] | None = None,
                   image_names: Sequence[str] | None = None, mean: Sequence[float] | None = None,
                   std: Sequence[float] | None = None, title: str = "vitscope explorer",
                   probes: Probes | None = None, max_bytes: int = DEFAULT_MAX_PAGE_BYTES) -> Path:
    """Write the explorer for `images` (B, C, H, W) to `out_path` (.html): `explore(...).save(out_path)`."""
    return explore(model, images, labels=labels, class_names=class_names, stats=stats, importance=importance,
                   image_names=image_names, mean=mean, std=std, title=title, probes=probes,
                   max_bytes=max_bytes).save(out_path)

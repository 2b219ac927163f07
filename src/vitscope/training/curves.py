"""Pictures of a training run: learning curves and the confusion matrix (matplotlib figures, written as PNG)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vitscope.figures import Figure
from vitscope.training.task import Metric


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics: list[dict], out: Path, metric: Metric, title: str = "") -> Path:
    """Loss and the task's metric against epoch (with the training side's where the loop measures it), and
    the metric against training wall time."""
    rows = [m for m in metrics if metric.key in m]
    fig = Figure(figsize=(14, 4))
    axes = fig.subplots(1, 3)
    ep = [m["epoch"] for m in rows]
    test = [metric.scale(m[metric.key]) for m in rows]
    axes[0].plot(ep, [m["train_loss"] for m in rows], "o-", label="train")
    axes[0].plot(ep, [m["test_loss"] for m in rows], "o-", label="test")
    axes[0].set(xlabel="epoch", ylabel="loss", title="loss")
    if metric.train_key:
        axes[1].plot(ep, [metric.scale(m[metric.train_key]) for m in rows], "o-", label="train")
    axes[1].plot(ep, test, "o-", label="test")
    axes[1].set(xlabel="epoch", ylabel=metric.axis(), title=metric.name)
    axes[2].plot([m["train_time_s"] / 60 for m in rows], test, "o-")
    axes[2].set(xlabel="training wall time (min)", ylabel=f"test {metric.axis()}", title=f"{metric.name} vs time")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.save(out, dpi=110)
    return out


def plot_confusion(matrix: np.ndarray, classes: list[str], out: Path, title: str = "") -> Path:
    """Row-normalised confusion matrix (true class down, predicted class across), counts in cells."""
    matrix = np.asarray(matrix)
    norm = matrix / np.maximum(matrix.sum(1, keepdims=True), 1)
    n = len(classes)
    size = max(6, 0.55 * n + 2)
    fig = Figure(figsize=(size, size * 0.9))
    ax = fig.subplots()
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(n), classes, rotation=45, ha="right")
    ax.set_yticks(range(n), classes)
    ax.set(xlabel="predicted", ylabel="true", title=title or "confusion matrix (row-normalised)")
    if n <= 20:
        for i in range(n):
            for j in range(n):
                if matrix[i, j]:
                    ax.text(j, i, str(int(matrix[i, j])), ha="center", va="center", fontsize=7,
                            color="white" if norm[i, j] > 0.5 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.save(out, dpi=110)
    return out

"""Which heads matter: ablation, gradient sensitivity, ranking and the pruning curve.

A head is removed by zeroing its output before the attention's output projection
(`MultiHeadAttention.head_mask`), so nothing in the model code changes and the masks are put back
afterwards. A dataset is a pair of tensors (images (M, C, H, W) float, labels (M,) int64) or any
iterable of such (x, y) batches, e.g. a DataLoader.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitscope.inspect.capture import model_device, select_modules

Dataset = tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]]


def batches(dataset: Dataset, batch_size: int = 128) -> Iterator[tuple[Tensor, Tensor]]:
    if isinstance(dataset, tuple) and len(dataset) == 2 and isinstance(dataset[0], Tensor):
        x, y = dataset
        if len(x) != len(y):
            raise ValueError(f"images and labels differ in length: {len(x)} vs {len(y)}")
        for i in range(0, len(x), batch_size):
            yield x[i:i + batch_size], y[i:i + batch_size]
    else:
        yield from dataset


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 128) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of `model` on the dataset, in eval mode."""
    dev, total, loss, correct = model_device(model), 0, 0.0, 0
    for x, y in batches(dataset, batch_size):
        x, y = x.to(dev), y.to(dev)
        logits = model(x)
        loss += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        total += len(y)
    if total == 0:
        raise ValueError("the dataset is empty")
    return loss / total, correct / total


@contextmanager
def _masks_restored(model: nn.Module, layers=None):
    mods = [m for _, m in select_modules(model, layers)]
    saved = [m.head_mask for m in mods]
    was_training = model.training
    model.eval()
    try:
        yield mods
    finally:
        for m, old in zip(mods, saved):
            m.head_mask = old
        model.train(was_training)


@dataclass
class HeadImportance:
    """Importance per layer and head, (L, H): higher means the model needs the head more.

    For ablation `score` is the increase in loss when the head is removed alone; `delta_loss` and
    `delta_accuracy` are ablated minus baseline. For gradient sensitivity `score` is the mean
    |∂loss/∂mask| (Michel et al., 2019) and the deltas are None.
    """

    method: str
    names: list[str]
    score: np.ndarray
    base_loss: float | None = None
    base_accuracy: float | None = None
    delta_loss: np.ndarray | None = None
    delta_accuracy: np.ndarray | None = None

    def ranking(self) -> list[tuple[int, int]]:
        return rank_heads(self.score)

    def to_dict(self) -> dict:
        d = {"method": self.method, "names": self.names, "score": self.score.tolist(),
             "base_loss": self.base_loss, "base_accuracy": self.base_accuracy}
        if self.delta_loss is not None:
            d["delta_loss"] = self.delta_loss.tolist()
            d["delta_accuracy"] = self.delta_accuracy.tolist()
        return d


def rank_heads(score: np.ndarray) -> list[tuple[int, int]]:
    """(layer, head) pairs from most to least important (ties keep model order)."""
    flat = np.asarray(score, dtype=np.float64).ravel()
    order = np.argsort(-flat, kind="stable")
    h = score.shape[1]
    return [(int(i // h), int(i % h)) for i in order]


def ablation_importance(model: nn.Module, dataset: Dataset, *, layers=None, batch_size: int = 128
                        ) -> HeadImportance:
    """Remove each head alone and measure the change in loss and accuracy over `dataset`."""
    names = [n for n, _ in select_modules(model, layers)]
    with _masks_restored(model, layers) as mods:
        base_loss, base_acc = evaluate(model, dataset, batch_size)
        dl = np.zeros((len(mods), max(m.num_heads for m in mods)))
        da = np.zeros_like(dl)
        for i, m in enumerate(mods):
            for h in range(m.num_heads):
                mask = torch.ones(m.num_heads, device=model_device(model))
                mask[h] = 0.0
                m.head_mask = mask
                loss, acc = evaluate(model, dataset, batch_size)
                dl[i, h], da[i, h] = loss - base_loss, acc - base_acc
            m.head_mask = None
    return HeadImportance("ablation", names, dl.copy(), base_loss, base_acc, dl, da)


def gradient_importance(model: nn.Module, dataset: Dataset, *, layers=None, batch_size: int = 128,
                        normalize_layers: bool = False) -> HeadImportance:
    """Head sensitivity |∂loss/∂ξ_h| with a mask ξ = 1 on every head's output, accumulated over
    batches and averaged per example (Michel, Levy & Neubig, "Are sixteen heads really better than
    one?", 2019). `normalize_layers` divides each layer by its L2 norm as they suggest."""
    names = [n for n, _ in select_modules(model, layers)]
    with _masks_restored(model, layers) as mods:
        dev = model_device(model)
        masks = [torch.ones(m.num_heads, device=dev, requires_grad=True) for m in mods]
        for m, xi in zip(mods, masks):
            m.head_mask = xi
        total = torch.zeros(len(mods), max(m.num_heads for m in mods), dtype=torch.float64)
        count = 0
        with torch.enable_grad():
            for x, y in batches(dataset, batch_size):
                x, y = x.to(dev), y.to(dev)
                loss = F.cross_entropy(model(x).float(), y, reduction="sum")
                grads = torch.autograd.grad(loss, masks)
                for i, g in enumerate(grads):
                    total[i, : len(g)] += g.abs().double().cpu()
                count += len(y)
    score = (total / max(count, 1)).numpy()
    if normalize_layers:
        score = score / np.maximum(np.linalg.norm(score, axis=1, keepdims=True), 1e-20)
    return HeadImportance("gradient", names, score)


@dataclass
class PruningCurve:
    """Accuracy and loss after removing the first `removed[k]` heads of `order`."""

    order: list[tuple[int, int]]
    removed: list[int]
    accuracy: list[float]
    loss: list[float]

    def to_dict(self) -> dict:
        return {"order": [list(o) for o in self.order], "removed": self.removed, "accuracy": self.accuracy,
                "loss": self.loss}


def pruning_curve(model: nn.Module, dataset: Dataset, importance: HeadImportance | np.ndarray, *,
                  layers=None, steps: int | None = None, batch_size: int = 128) -> PruningCurve:
    """Remove heads cumulatively, least important first, and measure accuracy after each removal.

    `steps` evaluates at about that many evenly spaced counts instead of after every head.
    """
    score = importance.score if isinstance(importance, HeadImportance) else np.asarray(importance)
    mods = select_modules(model, layers)
    want = (len(mods), max(m.num_heads for _, m in mods))
    if score.shape != want:
        raise ValueError(f"got importance scores for {score.shape[0]} x {score.shape[1]} heads but the model "
                         f"has {want[0]} layers x {want[1]} heads; compute them with the same `layers`")
    order = [(layer, h) for layer, h in rank_heads(score)[::-1] if h < mods[layer][1].num_heads]
    total = len(order)
    counts = list(range(total + 1))
    if steps is not None and steps < total:
        counts = sorted(set(np.linspace(0, total, steps + 1).round().astype(int).tolist()))
    removed, accs, losses = [], [], []
    with _masks_restored(model, layers) as mods:
        dev = model_device(model)
        masks = [torch.ones(m.num_heads, device=dev) for m in mods]
        for m, xi in zip(mods, masks):
            m.head_mask = xi
        done = 0
        for c in counts:
            for layer, head in order[done:c]:
                masks[layer][head] = 0.0
            done = c
            loss, acc = evaluate(model, dataset, batch_size)
            removed.append(c)
            accs.append(acc)
            losses.append(loss)
    return PruningCurve(order, removed, accs, losses)

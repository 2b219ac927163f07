"""Evaluating a model on a split, and the report of a finished run (its pictures and summary.json)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vitscope.data import ImageDataset
from vitscope.data.transforms import TrainTransform, eval_transform, tta_views
from vitscope.io import atomic_write
from vitscope.kernels import allocator
from vitscope.training import distributed as D
from vitscope.training.config import TrainConfig

if TYPE_CHECKING:
    from vitscope.training.loop import TrainResult


@torch.no_grad()
def evaluate(model: nn.Module, data: ImageDataset, mean, std, *, batch_size: int = 1000, bf16: bool = False,
             device: torch.device | None = None, info: D.DistInfo | None = None, flip: bool = False,
             shift: int = 0) -> dict:
    """Loss, accuracy and confusion matrix over `data` (sharded over ranks, summed).

    Test-time augmentation, the logits of the views averaged (data.transforms.tta_views): `flip` adds
    each image's mirror image, `shift` the image moved that many pixels each way along each axis.
    """
    device = device or torch.device("cpu")
    info = info or D.DistInfo()
    model.eval()
    k = len(data.classes)
    conf = torch.zeros(k, k, dtype=torch.int64)
    loss_sum = torch.zeros(1, dtype=torch.float64)
    views = []
    idx = torch.arange(info.rank, len(data), info.world_size)
    for s in range(0, len(idx), batch_size):
        b = idx[s : s + batch_size]
        x = eval_transform(data.images[b], mean, std).to(device)
        y = data.labels[b]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            views = [model(v).float() for v in tta_views(x, flip=flip, shift_px=shift)]
            logits = torch.stack(views).mean(0)
        logits = logits.cpu()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        conf += torch.bincount(y * k + logits.argmax(1), minlength=k * k).view(k, k)
    D.all_reduce_sum(conf, info)
    D.all_reduce_sum(loss_sum, info)
    n = int(conf.sum())
    return {"loss": float(loss_sum) / n, "acc": float(conf.diag().sum()) / n, "confusion": conf.numpy(),
            "views": len(views)}



def write_report(run_dir: Path, cfg: TrainConfig, model: nn.Module, result: TrainResult, final: dict,
                 eval_set: ImageDataset, transform: TrainTransform) -> None:
    """Pictures and the summary of a finished run: curves.png, confusion.png, summary.json, explorer.html."""
    from vitscope.training.curves import plot_confusion, plot_curves, read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    plot_curves(rows, run_dir / "curves.png", title=f"{cfg.model} on {cfg.dataset}")
    plot_confusion(final["confusion"], eval_set.classes, run_dir / "confusion.png",
                   title=f"{cfg.model}: test accuracy {100 * final['acc']:.2f}%")
    conf = final["confusion"]
    per_class = {c: float(conf[i, i] / max(conf[i].sum(), 1)) for i, c in enumerate(eval_set.classes)}
    summary = {
        "model": cfg.model, "dataset": cfg.dataset, "test_acc": result.test_acc, "best_test_acc": result.best_acc,
        "per_class_acc": per_class, "train_time_s": round(result.train_time_s, 1),
        "images_per_s": round(result.images_per_s, 1), "parameters": model.num_params(),
        "epochs": cfg.epochs, "seed": cfg.seed,
        "test_views": final["views"],
        "last_epoch_test_acc": next((r["test_acc"] for r in reversed(rows) if "test_acc" in r), None),
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "malloc_mmap_threshold": allocator.applied()},
    }
    atomic_write(run_dir / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=2)))
    if cfg.explain_images:
        try:
            from vitscope.inspect.explorer import write_explorer
        except ImportError:
            return
        n = min(cfg.explain_images, len(eval_set))
        images = eval_set.images[:n]
        write_explorer(model.eval(), images, run_dir / "explorer.html", labels=eval_set.labels[:n].tolist(),
                       class_names=eval_set.classes, mean=transform.mean, std=transform.std)

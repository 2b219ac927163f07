"""Evaluating a classifier on a split: loss, accuracy and the confusion matrix, with test-time augmentation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vitscope.data import ImageDataset
from vitscope.data.transforms import eval_transform, tta_views
from vitscope.training import distributed


@torch.no_grad()
def evaluate(model: nn.Module, data: ImageDataset, mean, std, *, batch_size: int = 1000, bf16: bool = False,
             device: torch.device | None = None, info: distributed.DistInfo | None = None, flip: bool = False,
             shift: int = 0) -> dict:
    """Loss, accuracy and confusion matrix over `data` (sharded over ranks, summed).

    Test-time augmentation, the logits of the views averaged (data.transforms.tta_views): `flip` adds
    each image's mirror image, `shift` the image moved that many pixels each way along each axis.
    """
    device = device or torch.device("cpu")
    info = info or distributed.DistInfo()
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
    distributed.all_reduce_sum(conf, info)
    distributed.all_reduce_sum(loss_sum, info)
    n = int(conf.sum())
    return {"loss": float(loss_sum) / n, "acc": float(conf.diag().sum()) / n, "confusion": conf.numpy(),
            "views": len(views)}

"""Mixing a batch: MixUp (Zhang et al., 2018) blends each image with a partner from the same batch, CutMix (Yun et
al., 2019) pastes a box from the partner; both mix the one-hot targets by the same share, so the loss reads soft
targets (B, num_classes). As the rest of the augmentation (transforms.py), every draw comes from an explicit
`torch.Generator`, so a resumed run mixes exactly the same batches.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _beta(alpha: float, generator: torch.Generator) -> float:
    # torch's Beta sampler cannot take a generator; seed numpy from ours so resume stays exact.
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return float(np.random.default_rng(seed).beta(alpha, alpha))


def one_hot(y: torch.Tensor, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    off = smoothing / num_classes
    return torch.full((y.shape[0], num_classes), off, device=y.device).scatter_(
        1, y.view(-1, 1), 1.0 - smoothing + off
    )


def mixup(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    generator: torch.Generator,
    *,
    alpha: float = 0.8,
    smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blend each image with a partner from the same batch by a Beta(alpha, alpha) weight."""
    lam = _beta(alpha, generator)
    perm = torch.randperm(x.shape[0], generator=generator).to(x.device)
    target = one_hot(y, num_classes, smoothing)
    return lam * x + (1 - lam) * x[perm], lam * target + (1 - lam) * target[perm]


def cutmix(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    generator: torch.Generator,
    *,
    alpha: float = 1.0,
    smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paste a box from a partner image; the targets mix by the box's true area (after clipping)."""
    b, _, h, w = x.shape
    lam = _beta(alpha, generator)
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(h * cut), int(w * cut)
    cy, cx = (
        int(v)
        for v in torch.randint(0, h, (1,), generator=generator).tolist()
        + torch.randint(0, w, (1,), generator=generator).tolist()
    )
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
    perm = torch.randperm(b, generator=generator).to(x.device)
    out = x.clone()
    out[:, :, y0:y1, x0:x1] = x[perm, :, y0:y1, x0:x1]
    lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
    target = one_hot(y, num_classes, smoothing)
    return out, lam * target + (1 - lam) * target[perm]


def mix(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    generator: torch.Generator,
    *,
    mixup_alpha: float = 0.0,
    cutmix_alpha: float = 0.0,
    mix_prob: float = 1.0,
    switch_prob: float = 0.5,
    smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or cutmix on a batch with probability `mix_prob` (one of the two, at `switch_prob`
    for cutmix, when both alphas are set). Always returns soft targets (B, num_classes) that sum
    to 1, label-smoothed by `smoothing`, so the loss has one form."""
    use = float(torch.rand(1, generator=generator)) < mix_prob
    use_cutmix = float(torch.rand(1, generator=generator)) < switch_prob
    if use and cutmix_alpha > 0 and (mixup_alpha <= 0 or use_cutmix):
        return cutmix(x, y, num_classes, generator, alpha=cutmix_alpha, smoothing=smoothing)
    if use and mixup_alpha > 0:
        return mixup(x, y, num_classes, generator, alpha=mixup_alpha, smoothing=smoothing)
    return x, one_hot(y, num_classes, smoothing)

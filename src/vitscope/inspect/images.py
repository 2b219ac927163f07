"""Images in and out of the inspection tools: model inputs and display copies (image files are read by
`vitscope.data.image_files`).

A picture is best drawn from the original uint8 image; the model needs it normalised. Functions
here accept either: uint8 (B, C, H, W) with the training `mean`/`std` (0..1 scale, per channel),
or float tensors already as the model takes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from vitscope.errors import ConfigError


def model_inputs(images: Tensor, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
                 ) -> tuple[Tensor, Tensor]:
    """(what the model takes, what to draw). uint8 images are normalised with mean/std (or only
    scaled to 0..1 without them); float images are used as they are."""
    if images.ndim == 3:
        images = images[None]
    if images.dtype != torch.uint8:
        if mean is not None or std is not None:
            raise ValueError("mean/std apply to uint8 images; float images are taken as already normalised")
        return images.float(), images
    x = images.float() / 255.0
    if mean is not None and std is not None:
        c = x.shape[1]
        if len(mean) != c or len(std) != c:
            raise ConfigError(f"mean/std need {c} values for {c}-channel images, "
                             f"got {tuple(mean)} / {tuple(std)}")
        m = torch.tensor(mean, dtype=torch.float32).view(1, c, 1, 1)
        s = torch.tensor(std, dtype=torch.float32).view(1, c, 1, 1)
        x = (x - m) / s
    return x, images


def display_image(image: Tensor | np.ndarray) -> np.ndarray:
    """One image (C, H, W) -> (H, W) or (H, W, 3) in [0, 1]: uint8 as it is, float stretched to its range."""
    if isinstance(image, Tensor):
        image = image.detach().cpu()
        a = image.numpy().astype(np.float32) / 255.0 if image.dtype == torch.uint8 else image.float().numpy()
        if image.dtype != torch.uint8:
            a = (a - a.min()) / max(float(a.max() - a.min()), 1e-8)
    else:
        a = np.asarray(image, np.float32)
        a = (a - a.min()) / max(float(a.max() - a.min()), 1e-8)
    return a[0] if a.shape[0] == 1 else np.moveaxis(a[:3], 0, -1)

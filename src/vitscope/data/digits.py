"""scikit-learn's bundled 8x8 digits (1,797 images): a tiny dataset for smoke tests that needs
no files. scikit-learn is optional; the split is a fixed, seeded, stratified 80/20."""

from __future__ import annotations

import numpy as np
import torch

from vitscope.data.base import DataError, ImageDataset, channel_stats


def load_digits(split: str = "train", *, test_fraction: float = 0.2, seed: int = 0) -> ImageDataset:
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise DataError(
            "the digits dataset comes with scikit-learn, which is not installed: pip install scikit-learn"
        ) from None
    if split not in ("train", "test"):
        raise DataError(f"digits has splits 'train' and 'test', not {split!r}")
    bunch = sklearn_digits()
    # Pixel values are counts 0..16; scale them onto 0..255.
    images = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[:, None]  # (N, 1, 8, 8)
    labels = bunch.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_idx = []
    for label in range(10):
        members = np.flatnonzero(labels == label)
        test_idx += list(rng.permutation(members)[: int(round(len(members) * test_fraction))])
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[test_idx] = True
    pick = is_test if split == "test" else ~is_test
    train_images = torch.from_numpy(images[~is_test])
    mean, std = channel_stats(train_images)
    return ImageDataset(
        images=torch.from_numpy(images[pick]),
        labels=torch.from_numpy(labels[pick]),
        classes=[str(i) for i in range(10)],
        name="digits",
        mean=mean,
        std=std,
    )

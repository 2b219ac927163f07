"""CIFAR-10, binary version: `data_batch_1.bin` .. `data_batch_5.bin`, `test_batch.bin` and
`batches.meta.txt`, in `root` or `root/cifar-10-batches-bin/` (the archive's own folder).

Each record is 3073 bytes: one label byte, then 1024 red, 1024 green and 1024 blue bytes of a
32x32 image, row by row. Get the archive `cifar-10-binary.tar.gz` from
https://www.cs.toronto.edu/~kriz/cifar.html and unpack it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vitscope.data.base import DataError, ImageDataset, cache_dir

RECORD = 1 + 3 * 32 * 32
FILES = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
RECORDS_PER_FILE = 10000
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def find_root(root: str | Path | None) -> Path:
    base = Path(root).expanduser() if root is not None else cache_dir("cifar10")
    for candidate in (base, base / "cifar-10-batches-bin"):
        if (candidate / "test_batch.bin").is_file() or (candidate / "data_batch_1.bin").is_file():
            return candidate
    raise DataError(
        f"CIFAR-10 binary files not found in {base} "
        "(need data_batch_1..5.bin, test_batch.bin, batches.meta.txt). "
        "Download cifar-10-binary.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html, unpack it there "
        "or pass root=DIR (--data-dir DIR)"
    )


def read_batch(path: Path, *, official: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One .bin file -> uint8 images (N, 3, 32, 32) and labels (N,), with size and label checks."""
    if not path.is_file():
        raise DataError(f"{path} is missing; unpack cifar-10-binary.tar.gz again")
    data = np.fromfile(path, dtype=np.uint8)
    if data.size == 0 or data.size % RECORD:
        raise DataError(
            f"{path}: {data.size} bytes is not a whole number of {RECORD}-byte records; "
            "the file is truncated or not CIFAR-10 binary: unpack it again"
        )
    records = data.reshape(-1, RECORD)  # (N, 3073)
    if official and records.shape[0] != RECORDS_PER_FILE:
        raise DataError(
            f"{path}: {records.shape[0]} records, an official CIFAR-10 file has {RECORDS_PER_FILE} "
            "(pass verify=False for files made on purpose)"
        )
    labels = records[:, 0]
    if labels.max() > 9:
        bad = int(np.argmax(labels > 9))
        raise DataError(f"{path}: record {bad} has label {labels[bad]}, CIFAR-10 labels are 0..9")
    images = records[:, 1:].reshape(-1, 3, 32, 32)  # (N, C, H, W): channel planes, rows
    return images, labels


def read_classes(directory: Path) -> list[str]:
    meta = directory / "batches.meta.txt"
    if not meta.is_file():
        return list(CLASSES)
    names = [line.strip() for line in meta.read_text().splitlines() if line.strip()]
    if len(names) != 10:
        raise DataError(f"{meta}: expected 10 class names, found {len(names)}")
    return names


def load_cifar10(
    root: str | Path | None = None, split: str = "train", *, verify: bool = True
) -> ImageDataset:
    if split not in FILES:
        raise DataError(f"cifar10 has splits 'train' and 'test', not {split!r}")
    directory = find_root(root)
    batches = [read_batch(directory / f, official=verify) for f in FILES[split]]
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches]).astype(np.int64)
    return ImageDataset(
        images=torch.from_numpy(images),
        labels=torch.from_numpy(labels),
        classes=read_classes(directory),
        name="cifar10",
        mean=MEAN,
        std=STD,
    )


def verify_cifar10(root: str | Path | None = None) -> list[str]:
    directory = find_root(root)
    lines = []
    for files in FILES.values():
        for f in files:
            images, labels = read_batch(directory / f, official=True)
            counts = np.bincount(labels, minlength=10)
            lines.append(
                f"{directory / f}: {images.shape[0]} records of 3x32x32, labels 0..9 "
                f"({counts.min()}-{counts.max()} per class)"
            )
    lines.append(f"classes: {', '.join(read_classes(directory))}")
    return lines

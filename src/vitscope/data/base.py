"""What every data source shares: the dataset record, the error type, the cache directory and verified
downloads (written whole by vitscope.io.atomic_write_bytes).

Every source turns into an `ImageDataset`: uint8 images (N, C, H, W) and int64 labels held in
memory, with the per-channel mean and std used to normalise them.
"""

from __future__ import annotations

import hashlib
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from vitscope.errors import VitscopeError
from vitscope.io import atomic_write_bytes, data_root


class DataError(VitscopeError):
    """A data file is missing, damaged or not what was asked for. The message says what to do."""


@dataclass
class ImageDataset:
    """A whole split in memory.

    `mean` and `std` are per channel on the 0..1 scale. Normalise every split of a dataset with
    the statistics of its training split (the named datasets carry those for both splits).
    """

    images: torch.Tensor  # uint8 (N, C, H, W), contiguous
    labels: torch.Tensor  # int64 (N,)
    classes: list[str]
    name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise ValueError(
                f"images must be uint8 (N, C, H, W), got {self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise ValueError(
                f"labels must be int64 of shape ({self.images.shape[0]},), "
                f"got {self.labels.dtype} {tuple(self.labels.shape)}"
            )
        c = self.images.shape[1]
        if len(self.mean) != c or len(self.std) != c:
            raise ValueError(f"mean/std need {c} values (one per channel), got {self.mean} / {self.std}")
        self.images = self.images.contiguous()

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        c, h, w = self.images.shape[1:]
        return (c, h, w)


# -- where data lives ------------------------------------------------------------------------------
def cache_root() -> Path:
    """Where datasets are downloaded and decoded images cached: `$VITSCOPE_DATA`, else vitscope's cache folder
    (vitscope.io.data_root)."""
    return data_root()


def cache_dir(name: str) -> Path:
    return data_root() / name


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download(
    urls: Sequence[str],
    dest: Path,
    *,
    check: Callable[[bytes], None],
    opener: Callable[..., object] | None = None,
    timeout: float = 60.0,
) -> Path:
    """Fetch the first of `urls` that answers, `check` its bytes, then write `dest` atomically.

    `check` raises DataError when the content is wrong; nothing is written then. All mirrors
    failing is a DataError naming each one and why.
    """
    opener = opener or urllib.request.urlopen
    failures = []
    for url in urls:
        try:
            with opener(url, timeout=timeout) as response:  # type: ignore[attr-defined]
                data = response.read()
        except OSError as e:  # URLError, HTTPError, timeouts and refused connections are all OSErrors
            failures.append(f"{url}: {e}")
            continue
        try:
            check(data)
        except DataError as e:
            failures.append(f"{url}: {e}")
            continue
        atomic_write_bytes(dest, data)
        return dest
    raise DataError(f"could not download {dest.name}:\n  " + "\n  ".join(failures))


# -- tensors ---------------------------------------------------------------------------------------
def channel_stats(images: torch.Tensor, chunk: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (N, C, H, W) on the 0..1 scale."""
    c = images.shape[1]
    total = torch.zeros(c, dtype=torch.float64)
    total_sq = torch.zeros(c, dtype=torch.float64)
    for start in range(0, images.shape[0], chunk):
        x = images[start : start + chunk].to(torch.float64) / 255.0
        total += x.sum(dim=(0, 2, 3))
        total_sq += (x * x).sum(dim=(0, 2, 3))
    n = max(images.shape[0] * images.shape[2] * images.shape[3], 1)
    mean = total / n
    std = (total_sq / n - mean * mean).clamp_min(1e-12).sqrt()
    # A channel that never varies (a single-colour dataset) would divide by zero when normalised: its std is
    # held at one grey level, 1/255, below which no uint8 channel can vary anyway.
    return (tuple(round(v, 4) for v in mean.tolist()),
            tuple(max(round(v, 4), round(1 / 255, 4)) for v in std.tolist()))


def resize_images(images: torch.Tensor, size: int) -> torch.Tensor:
    """Resize uint8 (N, C, H, W) to (N, C, size, size) with antialiased bilinear interpolation."""
    if images.shape[-2:] == (size, size):
        return images
    out = []
    for start in range(0, images.shape[0], 4096):
        x = images[start : start + 4096].float()
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out.append(x.round_().clamp_(0, 255).to(torch.uint8))
    return torch.cat(out).contiguous()

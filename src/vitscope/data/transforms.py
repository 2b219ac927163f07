"""Augmentation on batches of tensors (B, C, H, W), uint8 or float on the 0..1 scale.

All randomness comes from an explicit `torch.Generator` (never the global RNG), so a resumed run
that restores the generator's state draws exactly the same augmentations. Every random choice is
made per image but applied to the whole batch at once: gathers, masks and one warp per batch.
Crop, flip, erase and mixing (mixing.py) are written here, not taken from kornia.augmentation, because they
are a few tensor ops and faster that way on small images (256x1x28x28, one thread, fastest
decile: pad-2 reflect crop 0.53 ms vs kornia's RandomCrop 2.2 ms; resized crop 3.1 vs 9.1 ms;
erasing 0.72 vs 1.07 ms; flip the same 0.22 ms) and kornia draws from the global RNG.

    tf = TrainTransform(crop="pad", pad=2, flip=True, policy="trivial").for_dataset(train_set)
    x = tf(images_uint8, generator)                               # float32, normalised
    x, y_soft = tf.mix(x, labels, num_classes=10, generator=generator)
    x_eval = eval_transform(images_uint8, train_set.mean, train_set.std)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from vitscope.data.mixing import mix
from vitscope.data.policy import rand_augment, trivial_augment
from vitscope.errors import ConfigError

# RandAugment applies 1-3 ops an image (Cubuk et al.); more than this is a mistake, not a policy.
MAX_RANDAUG_OPS = 16


def to_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 0..255 -> float32 0..1; float tensors pass through."""
    return x.float().div_(255.0) if x.dtype == torch.uint8 else x


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(x / 255 - mean) / std per channel, float32. Float input is taken to be on the 0..1 scale."""
    c = x.shape[1]
    if len(mean) != c or len(std) != c:
        raise ConfigError(f"mean/std need {c} values for {c}-channel images, got {tuple(mean)} / {tuple(std)}")
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    return (to_float(x) - m) / s


def eval_transform(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    return normalize(x, mean, std)


def shift(x: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """Move the picture dx pixels right and dy down (negative: left, up), the uncovered edge reflected.

    (B, C, H, W) in, same out; the window a pad-|d| reflect crop at that offset would cut."""
    h, w = x.shape[-2:]
    if max(abs(dx), abs(dy)) >= min(h, w):
        raise ConfigError(f"a shift must be smaller than the image side, got ({dx}, {dy}) for {h}x{w}")
    rows = _reflect(torch.arange(h) - dy, h).to(x.device)  # (H,): source row of every output row
    cols = _reflect(torch.arange(w) - dx, w).to(x.device)  # (W,)
    return x.index_select(-2, rows).index_select(-1, cols)


def tta_views(x: torch.Tensor, *, flip: bool = False, shift_px: int = 0) -> Iterator[torch.Tensor]:
    """The views test-time augmentation averages: the image; with `shift_px`, the image moved that far
    left, right, up and down; with `flip`, the mirror image of each of those. 1, 2, 5 or 10 views."""
    moves = [(0, 0)] + ([(shift_px, 0), (-shift_px, 0), (0, shift_px), (0, -shift_px)] if shift_px else [])
    for dx, dy in moves:
        v = shift(x, dx, dy) if (dx or dy) else x
        yield v
        if flip:
            yield v.flip(-1)


# -- geometry --------------------------------------------------------------------------------------
def random_crop(
    x: torch.Tensor, pad: int, generator: torch.Generator, mode: Literal["reflect", "zero"] = "reflect"
) -> torch.Tensor:
    """Pad by `pad` on every side and cut an H x W window at a random offset per image; keeps dtype.

    Done as two gathers with reflected (or masked) indices, so the padded batch is never built."""
    b, c, h, w = x.shape
    if pad <= 0:
        return x
    if mode == "reflect" and pad >= min(h, w):
        raise ConfigError(f"reflect padding needs pad < image side, got pad={pad} for {h}x{w}")
    oy = torch.randint(0, 2 * pad + 1, (b, 1), generator=generator)
    ox = torch.randint(0, 2 * pad + 1, (b, 1), generator=generator)
    rows = torch.arange(h).view(1, h) + oy - pad  # (B, H), source row of every output row
    cols = torch.arange(w).view(1, w) + ox - pad  # (B, W)
    if mode == "reflect":
        rows, cols = _reflect(rows, h), _reflect(cols, w)
        valid = None
    else:
        valid = ((rows >= 0) & (rows < h)).view(b, 1, h, 1) & ((cols >= 0) & (cols < w)).view(b, 1, 1, w)
        rows, cols = rows.clamp(0, h - 1), cols.clamp(0, w - 1)
    rows, cols = rows.to(x.device), cols.to(x.device)  # drawn on the CPU generator, used where x lives
    out = x.gather(2, rows.view(b, 1, h, 1).expand(b, c, h, w))  # (B, C, H, W): rows picked
    out = out.gather(3, cols.view(b, 1, 1, w).expand(b, c, h, w))  # (B, C, H, W): then columns
    if valid is not None:
        out = out * valid.to(device=x.device, dtype=out.dtype)
    return out


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)


def _sample_boxes(
    b: int,
    h: int,
    w: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator,
    attempts: int = 10,
) -> tuple[torch.Tensor, ...]:
    """torchvision's box sampling (area fraction in `scale`, log-uniform aspect in `ratio`, up to
    10 tries) for every image at once. Returns top, left, height, width (B,) and whether a try fit."""
    area = h * w * torch.empty(b, attempts).uniform_(scale[0], scale[1], generator=generator)
    log_ratio = torch.empty(b, attempts).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = torch.exp(log_ratio)
    bw = torch.sqrt(area * aspect).round().long()
    bh = torch.sqrt(area / aspect).round().long()
    fits = (bw > 0) & (bw <= w) & (bh > 0) & (bh <= h)
    first = fits.float().argmax(dim=1, keepdim=True)  # first try that fits (0 when none does)
    bw, bh = bw.gather(1, first).squeeze(1), bh.gather(1, first).squeeze(1)
    found = fits.any(dim=1)
    u = torch.rand(b, 2, generator=generator)
    top = (u[:, 0] * (h - bh + 1).clamp_min(1)).long()
    left = (u[:, 1] * (w - bw + 1).clamp_min(1)).long()
    return top, left, bh, bw, found


def random_resized_crop(
    x: torch.Tensor,
    generator: torch.Generator,
    *,
    size: int | None = None,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> torch.Tensor:
    """Cut a random box per image (as torchvision's RandomResizedCrop) and resize it to `size`
    (default: the input size) with one bilinear grid_sample call. Returns float 0..1."""
    x = to_float(x)
    b, _, h, w = x.shape
    top, left, bh, bw, found = _sample_boxes(b, h, w, scale, ratio, generator)
    # Images where no try fit fall back to the whole image, as torchvision's centre crop does here.
    top, left = torch.where(found, top, 0), torch.where(found, left, 0)
    bh, bw = torch.where(found, bh, h), torch.where(found, bw, w)
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0] = bw / w
    theta[:, 1, 1] = bh / h
    theta[:, 0, 2] = (2 * left + bw) / w - 1  # box centre in normalised coordinates
    theta[:, 1, 2] = (2 * top + bh) / h - 1
    out_h, out_w = (size, size) if size is not None else (h, w)
    grid = F.affine_grid(theta.to(x.device), [b, x.shape[1], out_h, out_w], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def random_hflip(x: torch.Tensor, generator: torch.Generator, p: float = 0.5) -> torch.Tensor:
    flip = torch.rand(x.shape[0], generator=generator) < p
    return torch.where(flip.view(-1, 1, 1, 1).to(x.device), x.flip(-1), x)


def random_erase(
    x: torch.Tensor,
    generator: torch.Generator,
    *,
    p: float = 0.25,
    scale: tuple[float, float] = (0.02, 0.33),
    ratio: tuple[float, float] = (0.3, 3.3),
    value: float = 0.0,
) -> torch.Tensor:
    """Blank one random box in a fraction `p` of the images (torchvision's RandomErasing); on a
    normalised batch the default value 0 is the dataset mean."""
    b, _, h, w = x.shape
    apply = torch.rand(b, generator=generator) < p
    top, left, bh, bw, found = _sample_boxes(b, h, w, scale, ratio, generator)
    found &= (bh < h) & (bw < w)
    rows = torch.arange(h).view(1, h)
    cols = torch.arange(w).view(1, w)
    in_rows = (rows >= top.view(b, 1)) & (rows < (top + bh).view(b, 1))  # (B, H)
    in_cols = (cols >= left.view(b, 1)) & (cols < (left + bw).view(b, 1))  # (B, W)
    mask = in_rows.view(b, 1, h, 1) & in_cols.view(b, 1, 1, w) & (apply & found).view(b, 1, 1, 1)
    return x.masked_fill(mask.to(x.device), value)


# -- the training pipeline -------------------------------------------------------------------------
@dataclass
class TrainTransform:
    """The training augmentation, as a config: crop -> flip -> policy -> normalise -> erase.

    `mean`/`std`, where not given, are the training split's (`for_dataset(ds)` fills them). Mixing needs the labels,
    so it is the separate step `mix`."""

    # Each field's help is its `vitscope train --help` line, under --aug-<field>.
    crop: Literal["pad", "rrc", "none"] = dataclasses.field(default="pad", metadata={
        "help": "pad: pad and crop back at a random place; rrc: random resized crop; none"})
    pad: int = dataclasses.field(default=2, metadata={"help": "pixels of padding a side, for --aug-crop pad"})
    pad_mode: Literal["reflect", "zero"] = dataclasses.field(default="reflect", metadata={
        "help": "what the padding holds: the image reflected, or zeros"})
    # torchvision's 0.08 leaves too little of a 28x28 image
    rrc_scale: tuple[float, float] = dataclasses.field(default=(0.35, 1.0), metadata={
        "help": "random resized crop: the range of the crop's share of the image's area"})
    rrc_ratio: tuple[float, float] = dataclasses.field(default=(3 / 4, 4 / 3), metadata={
        "help": "random resized crop: the range of the crop's width over its height"})
    flip: bool = dataclasses.field(default=True, metadata={"help": "mirror half the images left to right"})
    policy: Literal["none", "trivial", "randaug"] = dataclasses.field(default="none", metadata={
        "help": "an augmentation policy: TrivialAugment or RandAugment"})
    randaug_ops: int = dataclasses.field(default=2, metadata={"help": "RandAugment's ops an image"})
    randaug_magnitude: int = dataclasses.field(default=9, metadata={"help": "RandAugment's magnitude, a bin of 0..30"})
    erase_p: float = dataclasses.field(default=0.0, metadata={
        "help": "the chance each image has a random rectangle erased (random erasing)"})
    mixup_alpha: float = dataclasses.field(default=0.0, metadata={"help": "mixup's Beta(alpha, alpha); 0: off"})
    cutmix_alpha: float = dataclasses.field(default=0.0, metadata={"help": "CutMix's Beta(alpha, alpha); 0: off"})
    mix_prob: float = dataclasses.field(default=1.0, metadata={
        "help": "the chance a batch is mixed (mixup or CutMix, half each when both are on)"})
    mean: tuple[float, ...] | None = dataclasses.field(default=None, metadata={
        "help": "normalising mean per channel; none: the training split's"})
    std: tuple[float, ...] | None = dataclasses.field(default=None, metadata={
        "help": "normalising std per channel; none: the training split's"})

    def __post_init__(self) -> None:
        choices = {
            "crop": ("pad", "rrc", "none"),
            "pad_mode": ("reflect", "zero"),
            "policy": ("none", "trivial", "randaug"),
        }
        for field, allowed in choices.items():
            if getattr(self, field) not in allowed:
                raise ConfigError(f"{field} must be one of {', '.join(allowed)}, got {getattr(self, field)!r}")
        # every number in its range, NaN and infinity in none (a NaN compares False both ways)
        for field in ("erase_p", "mix_prob"):
            if not 0.0 <= getattr(self, field) <= 1.0:
                raise ConfigError(f"{field} is a probability in [0, 1], got {getattr(self, field)}")
        for field in ("pad", "randaug_ops", "mixup_alpha", "cutmix_alpha"):
            v = getattr(self, field)
            if not (0 <= v < math.inf):
                raise ConfigError(f"{field} must be a finite number, at least 0 (0: off), got {v}")
        if self.randaug_ops > MAX_RANDAUG_OPS:  # each op is a pass over the batch: 10^12 of them never end
            raise ConfigError(f"randaug_ops is the number of ops applied to an image in turn, at most "
                              f"{MAX_RANDAUG_OPS} (RandAugment uses 1-3), got {self.randaug_ops}")
        if not 0 <= self.randaug_magnitude <= 30:
            raise ConfigError(f"randaug_magnitude is a bin of 0..30, got {self.randaug_magnitude}")
        for field in ("rrc_scale", "rrc_ratio"):
            lo_hi = tuple(getattr(self, field))
            high = 1.0 if field == "rrc_scale" else math.inf
            if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1] <= high or not math.isfinite(lo_hi[1]):
                raise ConfigError(f"{field} is a range of two finite positive numbers, low then high"
                                  f"{' (at most 1: a share of the image)' if high == 1 else ''}, e.g. "
                                  f"--aug-{field.replace('_', '-')} {'0.35 1.0' if high == 1 else '0.75 1.33'}; "
                                  f"got {lo_hi}")
        for field in ("mean", "std"):
            values = getattr(self, field)
            if values is not None and not all(math.isfinite(v) and (field == "mean" or v > 0) for v in values):
                raise ConfigError(f"{field} needs finite numbers{', each above 0' if field == 'std' else ''}, one "
                                  f"per channel; got {tuple(values)}")

    def for_dataset(self, dataset) -> TrainTransform:
        """This transform with the training split's mean and std, where they were not given."""
        mean = tuple(self.mean) if self.mean is not None else tuple(dataset.mean)
        std = tuple(self.std) if self.std is not None else tuple(dataset.std)
        c, h, w = dataset.images.shape[1:]
        if self.pad >= min(h, w):  # a crop of the padding alone, or (reflect) no padding PyTorch can make
            raise ConfigError(f"pad must be smaller than the images' side ({h}x{w} for {dataset.name}), got {self.pad}")
        if len(mean) != c or len(std) != c:
            raise ConfigError(f"mean and std need one number per channel, {c} for {dataset.name}; got mean "
                             f"{mean} and std {std}")
        return dataclasses.replace(self, mean=mean, std=std)

    @property
    def mixes(self) -> bool:
        return (self.mixup_alpha > 0 or self.cutmix_alpha > 0) and self.mix_prob > 0

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.mean is None or self.std is None:
            raise ConfigError(
                "TrainTransform needs the training split's mean/std: use .for_dataset(train_set)"
            )
        if self.crop == "pad":
            x = random_crop(x, self.pad, generator, mode=self.pad_mode)
        elif self.crop == "rrc":
            x = random_resized_crop(x, generator, scale=self.rrc_scale, ratio=self.rrc_ratio)
        if self.flip:
            x = random_hflip(x, generator)
        x = to_float(x)
        if self.policy == "trivial":
            x = trivial_augment(x, generator)
        elif self.policy == "randaug":
            x = rand_augment(x, generator, num_ops=self.randaug_ops, magnitude=self.randaug_magnitude)
        x = normalize(x, self.mean, self.std)
        if self.erase_p > 0:
            x = random_erase(x, generator, p=self.erase_p)
        return x

    def mix(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        num_classes: int,
        generator: torch.Generator,
        smoothing: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return mix(
            x,
            y,
            num_classes,
            generator,
            mixup_alpha=self.mixup_alpha,
            cutmix_alpha=self.cutmix_alpha,
            mix_prob=self.mix_prob,
            smoothing=smoothing,
        )

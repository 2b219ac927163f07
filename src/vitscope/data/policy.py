"""TrivialAugment and RandAugment on batches: every image draws its own operation and magnitude
from an explicit generator, and each operation runs once on the sub-batch that drew it.

The image operations are kornia's (equalize, posterize, solarize, sharpness, contrast, saturation,
affine warps), checked against PIL.ImageOps in the tests; only parameter sampling, batching and two
one-line ops are written here. The ops take float images on the 0..1 scale, (B, C, H, W).

Magnitudes follow torchvision's RandAugment ranges (rotate <= 30 deg, shear <= 0.3, translate
<= 45% of the side, enhance factors 1 +- 0.9, posterize 8..4 bits, solarize threshold 1..0), also
for TrivialAugment: TrivialAugment-Wide's 135 deg rotations and 32-pixel shifts wipe out a 28x28
image.

Measured on 256x1x28x28 float batches, one thread, on the shared 2-core dev machine (torch 2.13
CPU, kornia 0.9.0; fastest-decile times, medians were noisy under other jobs' load): a
TrivialAugment batch ~3.1 ms, RandAugment (2 ops, bin 9) ~9.5 ms. kornia's own `TrivialAugment`
module takes ~0.9 ms but picks one op per *batch* from the global RNG, which suits neither
per-image diversity nor exact resume, hence the sampling here.
"""

from __future__ import annotations

import torch

from vitscope.errors import ConfigError

NUM_BINS = 31  # magnitude bins 0..30, as torchvision
GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
PHOTOMETRIC = ("autocontrast", "equalize", "posterize", "solarize", "brightness", "contrast", "sharpness")


def op_names(channels: int) -> tuple[str, ...]:
    """The operation set; `color` (saturation) only exists for RGB."""
    return ("identity", *GEOMETRIC, *PHOTOMETRIC, *(("color",) if channels == 3 else ()))


# -- operations kornia does not have in PIL's sense ------------------------------------------------
def brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    # PIL's Brightness blends with black: a multiplication (kornia's adjust_brightness adds instead).
    return (x * factor.to(x.device).view(-1, 1, 1, 1)).clamp_(0, 1)


def autocontrast(x: torch.Tensor) -> torch.Tensor:
    # Stretch every channel to 0..1 and leave constant channels alone, as PIL/torchvision do
    # (kornia's normalize_min_max turns them black).
    lo = x.amin(dim=(-2, -1), keepdim=True)
    hi = x.amax(dim=(-2, -1), keepdim=True)
    flat = hi <= lo
    scale = torch.where(flat, torch.ones_like(hi), 1.0 / (hi - lo))
    lo = torch.where(flat, torch.zeros_like(lo), lo)
    return ((x - lo) * scale).clamp_(0, 1)


def _affine_matrices(
    ops: torch.Tensor, magnitude: torch.Tensor, sign: torch.Tensor, h: int, w: int
) -> torch.Tensor:
    """(B, 2, 3) pixel-space matrices about the image centre; `ops[i]` indexes GEOMETRIC."""
    m = magnitude * sign
    is_op = {name: (ops == k).to(m.dtype) for k, name in enumerate(GEOMETRIC)}
    cx, cy = (w - 1) / 2, (h - 1) / 2
    angle = torch.deg2rad(30.0 * m) * is_op["rotate"]
    c, s = torch.cos(angle), torch.sin(angle)
    shear_x, shear_y = 0.3 * m * is_op["shear_x"], 0.3 * m * is_op["shear_y"]
    tx = 150 / 331 * w * m * is_op["translate_x"]
    ty = 150 / 331 * h * m * is_op["translate_y"]
    # Only one of rotation, shear and translation is non-trivial per sample, so their sum
    # (rotation about the centre + shear about the centre + shift) is that sample's matrix.
    a, b = c, -s + shear_x
    d, e = s + shear_y, c
    row0 = torch.stack([a, b, cx - a * cx - b * cy + tx], dim=1)
    row1 = torch.stack([d, e, cy - d * cx - e * cy + ty], dim=1)
    return torch.stack([row0, row1], dim=1)  # (B, 2, 3)


def apply_ops(
    x: torch.Tensor, op_index: torch.Tensor, magnitude: torch.Tensor, sign: torch.Tensor
) -> torch.Tensor:
    """Apply op `op_index[i]` with `magnitude[i]` in 0..1 and `sign[i]` in {-1, 1} to image i."""
    try:
        import kornia.enhance as KE
        from kornia.geometry.transform import warp_affine
    except ImportError as e:
        raise ImportError(
            "the augmentation policies (policy='trivial' or 'randaug') use kornia: pip install kornia"
        ) from e

    names = op_names(x.shape[1])
    out = x.clone()
    first_geometric = names.index(GEOMETRIC[0])
    geometric = op_index - first_geometric  # index into GEOMETRIC, or outside 0..4
    idx = ((geometric >= 0) & (geometric < len(GEOMETRIC))).nonzero().squeeze(1)
    if idx.numel():
        theta = _affine_matrices(geometric[idx], magnitude[idx], sign[idx], *x.shape[-2:])
        out[idx] = warp_affine(
            x[idx],
            theta.to(x.device),
            dsize=x.shape[-2:],
            mode="bilinear",
            padding_mode="zeros",
            align_corners=True,
        )
    factor = (1.0 + 0.9 * magnitude * sign).to(x.device)  # enhance ops
    for k, name in enumerate(names):
        idx = (op_index == k).nonzero().squeeze(1)
        if idx.numel() == 0 or name in GEOMETRIC or name == "identity":
            continue
        sub, f = x[idx], factor[idx]
        if name == "autocontrast":
            sub = autocontrast(sub)
        elif name == "equalize":
            sub = KE.equalize(sub)
        elif name == "posterize":
            bits = 8 - (magnitude[idx] * 4).round().to(device=x.device, dtype=torch.int64)
            sub = KE.posterize(sub, bits)
        elif name == "solarize":
            sub = KE.solarize(sub, thresholds=(1.0 - magnitude[idx]).to(x.device))
        elif name == "brightness":
            sub = brightness(sub, f)
        elif name == "contrast":
            sub = KE.adjust_contrast_with_mean_subtraction(sub, f)
        elif name == "sharpness":
            sub = KE.sharpness(sub, f).clamp_(0, 1)
        elif name == "color":
            sub = KE.adjust_saturation(sub, f).clamp_(0, 1)
        out[idx] = sub
    return out


def _signs(b: int, generator: torch.Generator) -> torch.Tensor:
    return torch.where(torch.rand(b, generator=generator) < 0.5, -1.0, 1.0)


def trivial_augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """TrivialAugment (Müller & Hutter, 2021): one op per image, a magnitude bin drawn uniformly."""
    b = x.shape[0]
    op_index = torch.randint(len(op_names(x.shape[1])), (b,), generator=generator)
    magnitude = torch.randint(NUM_BINS, (b,), generator=generator).float() / (NUM_BINS - 1)
    return apply_ops(x, op_index, magnitude, _signs(b, generator))


def rand_augment(
    x: torch.Tensor, generator: torch.Generator, *, num_ops: int = 2, magnitude: int = 9
) -> torch.Tensor:
    """RandAugment (Cubuk et al., 2020): `num_ops` ops per image in turn, all at bin `magnitude` of 0..30."""
    if not 0 <= magnitude < NUM_BINS:
        raise ConfigError(f"RandAugment magnitude is a bin 0..{NUM_BINS - 1}, got {magnitude}")
    b = x.shape[0]
    m = torch.full((b,), magnitude / (NUM_BINS - 1))
    for _ in range(num_ops):
        op_index = torch.randint(len(op_names(x.shape[1])), (b,), generator=generator)
        x = apply_ops(x, op_index, m, _signs(b, generator))
    return x

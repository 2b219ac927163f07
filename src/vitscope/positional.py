"""Positional information: learned tables, fixed sinusoidal 1-D and 2-D encodings, resampling."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from vitscope.errors import ConfigError, InputError


def sincos_1d(num_positions: int, dim: int, *, temperature: float = 10000.0) -> Tensor:
    """The Transformer paper's encoding (N, dim): PE[p, 2i] = sin(p / t^(2i/dim)), PE[p, 2i+1] = cos(...)."""
    if dim % 2:
        raise ConfigError(f"sincos_1d needs an even dim, got {dim}")
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    freq = temperature ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
    angles = pos * freq  # (N, dim/2)
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1)  # (N, dim/2, 2): interleave sin, cos
    return rearrange(pe, "n k two -> n (k two)").float()


def sincos_2d(height: int, width: int, dim: int, *, temperature: float = 10000.0) -> Tensor:
    """Fixed 2-D encoding for an H x W grid, (H·W, dim) in row-major patch order.

    A quarter of the channels each: sin(x), cos(x), sin(y), cos(y) (as in "Better plain ViT
    baselines" / vit-pytorch's simple_vit).
    """
    if dim % 4:
        raise ConfigError(f"sincos_2d needs dim divisible by 4, got {dim}")
    y, x = torch.meshgrid(
        torch.arange(height, dtype=torch.float64), torch.arange(width, dtype=torch.float64), indexing="ij"
    )
    quarter = dim // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float64) / max(quarter - 1, 1))
    x = x.flatten()[:, None] * omega[None]  # (H·W, dim/4)
    y = y.flatten()[:, None] * omega[None]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).float()


def resample_pos_embed(
    pos_embed: Tensor,
    new_size: tuple[int, int],
    old_size: tuple[int, int] | None = None,
    *,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> Tensor:
    """Resample a learned table (1, P + h·w, D) to a new grid (1, P + H·W, D); prefix rows kept.

    `old_size` defaults to a square grid. Interpolation runs in float32, as timm and transformers do.
    """
    n = pos_embed.shape[1] - num_prefix_tokens
    if old_size is None:
        side = math.isqrt(n)
        if side * side != n:
            raise InputError(f"pos_embed has {n} grid positions, not a square; pass old_size=(h, w)")
        old_size = (side, side)
    if old_size[0] * old_size[1] != n:
        raise InputError(f"old_size {old_size} does not match the {n} grid positions in pos_embed")
    if tuple(new_size) == tuple(old_size):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    grid = rearrange(grid, "1 (h w) d -> 1 d h w", h=old_size[0], w=old_size[1])
    grid = F.interpolate(
        grid.float(), size=tuple(new_size), mode=mode, antialias=antialias, align_corners=False
    )
    grid = rearrange(grid, "1 d h w -> 1 (h w) d").to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


class LearnedPositionalEmbedding(nn.Module):
    """A lookup table of `num_positions` learned vectors, added to (B, N, dim) inputs."""

    def __init__(self, num_positions: int, dim: int, *, std: float = 0.02):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_positions, dim) * std)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        n = x.shape[1]
        if offset + n > self.weight.shape[0]:
            raise ValueError(f"sequence of {offset + n} positions exceeds the table's {self.weight.shape[0]}")
        return x + self.weight[offset : offset + n]


class SinusoidalPositionalEncoding(nn.Module):
    """The fixed 1-D encoding as a non-persistent buffer, added to (B, N, dim) inputs."""

    def __init__(self, max_positions: int, dim: int, *, temperature: float = 10000.0):
        super().__init__()
        self.register_buffer("pe", sincos_1d(max_positions, dim, temperature=temperature), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        n = x.shape[1]
        if offset + n > self.pe.shape[0]:
            raise ValueError(f"sequence of {offset + n} positions exceeds max_positions={self.pe.shape[0]}")
        return x + self.pe[offset : offset + n].to(x.dtype)

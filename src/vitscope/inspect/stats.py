"""Statistics of attention maps: CLS maps, the four regions, mean distance, entropy.

Every function takes one layer's weights (B, H, N, N) and the token layout (prefix tokens first,
then an h x w grid of patches in row-major order), so non-square grids, any number of prefix
tokens and any batch size work the same way. Per-model summaries stack them into (L, H) arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange
from torch import Tensor

from vitscope.inspect.capture import AttentionCapture, TokenLayout

REGIONS = ("cls_cls", "cls_patch", "patch_cls", "patch_patch")
REGION_LABELS = {"cls_cls": "CLS→CLS", "cls_patch": "CLS→patches", "patch_cls": "patches→CLS",
                 "patch_patch": "patches→patches"}


def _check(weights: Tensor, layout: TokenLayout) -> None:
    if weights.ndim != 4 or weights.shape[-1] != layout.num_tokens or weights.shape[-2] != layout.num_tokens:
        raise ValueError(f"expected self-attention weights (B, H, {layout.num_tokens}, {layout.num_tokens}) "
                         f"for {layout.num_prefix_tokens} prefix token(s) and a {layout.grid[0]}x"
                         f"{layout.grid[1]} grid, got {tuple(weights.shape)}")


def query_map(weights: Tensor, layout: TokenLayout, query: int | None = 0) -> Tensor:
    """Where one query token looks among the patches: (..., Nq, N) -> (..., h, w).

    `query=None` averages all patch queries — the "CLS map" of a model without a CLS token
    (average pooling gives every patch's output the same weight).
    """
    p = layout.num_prefix_tokens
    if query is None:
        row = weights[..., p:, p:].mean(dim=-2)  # (..., h·w)
    else:
        row = weights[..., query, p:]
    return rearrange(row, "... (h w) -> ... h w", h=layout.grid[0], w=layout.grid[1])


def cls_maps(weights: Tensor, layout: TokenLayout) -> Tensor:
    """CLS→patch attention (B, H, h, w) of one layer: the first prefix token's row, or the mean of
    the patch rows when there is no prefix token."""
    _check(weights, layout)
    return query_map(weights, layout, 0 if layout.num_prefix_tokens else None)


def region_mass(weights: Tensor, num_prefix_tokens: int) -> Tensor:
    """Attention mass in the four regions, averaged over rows and batch: (H, 4) in REGIONS order.

    The prefix rows' two regions (CLS→CLS, CLS→patches) sum to 1, and so do the patch rows'
    (patches→CLS, patches→patches). Without prefix tokens the CLS rows do not exist (NaN) and
    patches→patches is 1.
    """
    p = num_prefix_tokens
    w = weights.float()
    to_prefix = w[..., :p].sum(-1)  # (B, H, N)
    to_patch = w[..., p:].sum(-1)
    nan = torch.full(w.shape[1:2], float("nan"))
    cls_cls = to_prefix[..., :p].mean((0, 2)) if p else nan
    cls_patch = to_patch[..., :p].mean((0, 2)) if p else nan
    patch_cls, patch_patch = to_prefix[..., p:].mean((0, 2)), to_patch[..., p:].mean((0, 2))
    return torch.stack([cls_cls, cls_patch, patch_cls, patch_patch], -1)


def patch_distances(layout: TokenLayout) -> Tensor:
    """(h·w, h·w) distances in pixels between patch centres, patches in row-major order."""
    gh, gw = layout.grid
    ys, xs = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64),
                            indexing="ij")
    centres = torch.stack([ys.flatten(), xs.flatten()], -1) * layout.patch_size  # (h·w, 2)
    return torch.cdist(centres, centres)


def mean_distance(weights: Tensor, layout: TokenLayout) -> Tensor:
    """Mean attention distance per head in pixels (H,), as in the ViT paper's Figure 7.

    For each patch query, the distance to every patch key (between patch centres, times the patch
    size) is weighted by attention; prefix tokens have no position, so they are left out as
    queries and as keys and each patch row is re-normalised over the patches before weighting.
    The result is averaged over patch queries and the batch.
    """
    _check(weights, layout)
    p = layout.num_prefix_tokens
    a = weights[..., p:, p:].double()  # (B, H, h·w, h·w)
    a = a / a.sum(-1, keepdim=True).clamp_min(1e-30)
    per_query = (a * patch_distances(layout).to(a.device)).sum(-1)  # (B, H, h·w)
    return per_query.mean((0, 2)).float()


def entropy(weights: Tensor) -> Tensor:
    """Mean entropy of the attention rows per head, in nats (H,): 0 for one-hot rows, log(Nk) for
    uniform ones. Averaged over every query row and the batch."""
    w = weights.double()
    h = -(w * torch.log(w.clamp_min(1e-30))).sum(-1)  # (B, H, Nq)
    return h.mean((0, 2)).float()


def nan_to_none(x):
    """For JSON, which has no NaN: regions that do not exist (CLS rows without a CLS token) become null."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, list):
        return [nan_to_none(v) for v in x]
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    return x


@dataclass
class HeadStats:
    """Per-layer, per-head statistics of one batch: arrays (L, H), regions (L, H, 4)."""

    names: list[str]
    distance: np.ndarray
    entropy: np.ndarray
    regions: np.ndarray
    layout: TokenLayout

    def region(self, name: str) -> np.ndarray:
        return self.regions[..., REGIONS.index(name)]

    def to_dict(self) -> dict:
        return {"names": self.names, "distance": self.distance.tolist(), "entropy": self.entropy.tolist(),
                "regions": {r: self.region(r).tolist() for r in REGIONS}, "layout": self.layout.to_dict()}


def head_stats(capture: AttentionCapture | Sequence[Tensor], layout: TokenLayout | None = None,
               names: list[str] | None = None) -> HeadStats:
    """Distance, entropy and the four regions for every captured encoder layer."""
    if isinstance(capture, AttentionCapture):
        layout = layout or capture.layout
        if layout is None:
            raise ValueError("head_stats needs the token layout (capture.layout or layout=...)")
        n = layout.num_tokens  # the encoder's layers; a decoder's differ in shape or are called often
        names = [k for k in capture.names
                 if len(capture.calls[k]) == 1 and tuple(capture[k].shape[-2:]) == (n, n)]
        layers = [capture[k] for k in names]
    else:
        layers = list(capture)
        names = names or [f"layer {i}" for i in range(len(layers))]
    if layout is None:
        raise ValueError("head_stats needs the token layout (capture.layout or layout=...)")
    return HeadStats(
        names=names,
        distance=torch.stack([mean_distance(w, layout) for w in layers]).numpy(),
        entropy=torch.stack([entropy(w) for w in layers]).numpy(),
        regions=torch.stack([region_mass(w, layout.num_prefix_tokens) for w in layers]).numpy(),
        layout=layout,
    )

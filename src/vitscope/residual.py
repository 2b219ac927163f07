"""What a residual branch passes through before it is added back: LayerScale and stochastic depth.

LayerScale (CaiT, Touvron et al. 2021) multiplies the branch by a learned per-channel scale that starts
small; stochastic depth (Huang et al. 2016) drops a sample's whole branch with probability p in training.
A ViT block uses both on its attention and MLP branches when its config asks for them (vitscope.vit.Block).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: drop a sample's whole residual branch with probability p in training."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)

"""The hybrid input of the ViT paper (section 3.1), small: a few convolutions before the patch projection.

A stack of 3x3 conv -> BatchNorm -> activation, one per (channels, stride); `PatchEmbed` (vitscope.vit) takes
the stack's total stride out of its patch, so the tokens still cover patch_size x patch_size pixels each.
"""

from __future__ import annotations

import math

from torch import nn

STEM_ACTS = {"gelu": nn.GELU, "relu": nn.ReLU}


class ConvStem(nn.Sequential):
    """The hybrid input of the ViT paper, small: 3x3 conv -> BatchNorm -> activation per (channels, stride)."""

    def __init__(self, in_chans: int, layers: list[tuple[int, int]], act: str = "gelu"):
        modules, c = [], in_chans
        for out, stride in layers:
            modules += [nn.Conv2d(c, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out), STEM_ACTS[act]()]
            c = out
        super().__init__(*modules)
        self.out_chans = c
        self.stride = math.prod(s for _, s in layers)

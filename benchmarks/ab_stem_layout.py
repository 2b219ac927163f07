"""A/B: the conv stem in channels-last memory (what vitscope does) against the default layout.

    python benchmarks/ab_stem_layout.py [--model vit_fmnist_quick] [--rounds 8] [--steps 8]

Both models live in one process and their timed rounds alternate (benchmarks/_ab.py); the table
gives each round's images/s and the median of the per-round ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from einops import rearrange

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ab as ab  # noqa: E402
from vitscope.models import create_model  # noqa: E402
from vitscope.vit import PatchEmbed  # noqa: E402


def _default_layout_forward(self: PatchEmbed, x: torch.Tensor) -> torch.Tensor:
    """PatchEmbed.forward without the channels-last input (the layout before this change)."""
    self.check(x)
    if self.stem is not None:
        x = self.stem(x)
    return rearrange(self.proj(x), "b d h w -> b (h w) d")


def make_step(model_name: str, channels_last: bool, batch: int):
    torch.manual_seed(0)
    model = create_model(model_name)
    if not channels_last:  # this model's patch embedding only
        model.patch_embed.to(memory_format=torch.contiguous_format)
        model.patch_embed.forward = _default_layout_forward.__get__(model.patch_embed)
    return ab.training_step(model, batch)


def main(argv: list[str] | None = None) -> None:
    ab.main(__doc__, "stem layout", lambda model, batch: {"channels-last": make_step(model, True, batch),
                                                         "default": make_step(model, False, batch)}, argv)


if __name__ == "__main__":
    main()

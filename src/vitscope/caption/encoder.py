"""The image side both captioners share: a vitscope ViT encoder and the memory a decoder reads from it.

    encoder = build_encoder("vit_fmnist_quick", {"img_size": 56})   # no classifier head
    memory  = encode_memory(encoder, images, "tokens")               # (B, N, De) after the last block
    memory  = encode_memory(encoder, images, "stem")                 # (B, gh·gw, De) before any block

Which memory:

- "tokens": every token after the last block, normalised; what a ViT captioner (and caption_quick's
  transformer) reads. Self-attention has mixed each of them with the whole image.
- "stem": the patch embedding's output grid, before positions and before any block: each token is
  the conv stem's (or the patch projection's) feature of its own region only, as the lecture's
  Show, Attend and Tell reads a CNN's last spatial feature map (14 x 14 x 512 of VGG in the paper).
  It is normalised per token without learned parameters (a LayerNorm with no affine), so both memories
  reach the decoder at the same scale. The encoder's blocks are not run.

`MemoryPositions` adds a learned position per image token (started as the 2-D sin-cos table), for
either memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitscope.errors import ConfigError
from vitscope.models import create_model
from vitscope.positional import sincos_2d
from vitscope.vit import VisionTransformer

MemorySource = Literal["tokens", "stem"]
MEMORY_SOURCES: tuple[str, ...] = get_args(MemorySource)


@dataclass
class EncoderSpec:
    """Which ViT encodes the image: a preset name, overrides of its config, pretrained weights."""

    preset: str = "vit_fmnist_quick"
    overrides: dict = field(default_factory=dict)
    pretrained: bool | str = False


def build_encoder(preset: str, overrides: dict | None = None, pretrained: bool | str = False) -> VisionTransformer:
    """A vitscope ViT without its classifier head (num_classes=0)."""
    return create_model(preset, pretrained=pretrained, **{**(overrides or {}), "num_classes": 0})


def check_memory_source(source: str) -> None:
    if source not in MEMORY_SOURCES:
        raise ConfigError(f"memory must be one of {', '.join(MEMORY_SOURCES)}, got {source!r}")


def encode_tokens(encoder: VisionTransformer, images: Tensor) -> Tensor:
    """images (B, C, H, W) -> every token after the last block, normalised: (B, N, De).

    With average pooling timm puts the final LayerNorm after pooling (`fc_norm`) and none on the
    tokens; it is applied per token here, so the memory is normalised either way.
    """
    x = encoder.forward_features(images)  # (B, N, De)
    if isinstance(encoder.norm, nn.Identity) and not isinstance(encoder.fc_norm, nn.Identity):
        x = encoder.fc_norm(x)
    return x


def encode_stem(encoder: VisionTransformer, images: Tensor) -> Tensor:
    """images (B, C, H, W) -> the patch embedding's grid in reading order, normalised per token:
    (B, gh·gw, De), no prefix tokens, no positions, no block."""
    x = encoder.patch_embed(images)  # (B, gh·gw, De)
    return F.layer_norm(x, x.shape[-1:])


def encode_memory(encoder: VisionTransformer, images: Tensor, source: MemorySource = "tokens") -> Tensor:
    return encode_stem(encoder, images) if source == "stem" else encode_tokens(encoder, images)


def memory_prefix_tokens(encoder: VisionTransformer, source: MemorySource = "tokens") -> int:
    """The tokens before the image grid in the memory (a class token): none in the stem's grid."""
    return 0 if source == "stem" else encoder.num_prefix_tokens


class MemoryPositions(nn.Module):
    """A learned position per image token, added to the encoder's output before a decoder reads it, as
    DETR adds positions to the keys its decoder cross-attends to. Initialised with the 2-D sin-cos table
    (zeros at prefix tokens such as the class token).

    Why: the encoder's own positions enter at its input only; a classifier trained to pool its tokens
    keeps little of them by the last block, and a captioner must say where each item is (its errors
    without the table were mostly items named at the wrong cell). The stem's grid carries no position
    at all. The measured effect on caption_quick is in benchmarks/RESULTS.md, Captioning.
    """

    def __init__(self, encoder: VisionTransformer, num_prefix_tokens: int | None = None):
        super().__init__()
        gh, gw = encoder.patch_embed.grid_size
        d = encoder.config.embed_dim
        prefix = encoder.num_prefix_tokens if num_prefix_tokens is None else num_prefix_tokens
        table = torch.cat([torch.zeros(prefix, d), sincos_2d(gh, gw, d)])
        self.table = nn.Parameter(table[None])  # (1, N, De)

    def forward(self, memory: Tensor) -> Tensor:
        return memory + self.table  # (B, N, De)

"""The ViT that deep-learning tutorials teach, written the way they write it (for bench_vit.py).

This is the well-known teaching model (the University of Amsterdam deep-learning course's ViT and
the many notebooks that follow it): patches cut with reshape/permute, a Linear patch projection,
`nn.MultiheadAttention` in its default sequence-first layout called as `attn(x, x, x)[0]` (so
with the default `need_weights=True`, which averages and returns the attention weights that the
caller then throws away), a CLS token and learned positions drawn from `torch.randn`, and the
head on the CLS token. It is reproduced here, not imported, so the benchmark times the code as
tutorials ship it; nothing in vitscope uses it.

With the same width, depth, heads and MLP width it has exactly as many parameters as vitscope's
plain ViT: its `input_layer` is the patch conv written as a Linear, and its `mlp_head` LayerNorm
plays the part of vitscope's final norm. The benchmark builds it with dropout 0.0 so it does the
same work as the other implementations.
"""

from __future__ import annotations

import torch
from torch import nn


def img_to_patch(x: torch.Tensor, patch_size: int, flatten_channels: bool = True) -> torch.Tensor:
    """Images (B, C, H, W) -> patches (B, H'·W', C·p·p), or (B, H'·W', C, p, p) unflattened."""
    B, C, H, W = x.shape
    x = x.reshape(B, C, H // patch_size, patch_size, W // patch_size, patch_size)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, H', W', C, p, p)
    x = x.flatten(1, 2)  # (B, H'·W', C, p, p)
    if flatten_channels:
        x = x.flatten(2, 4)  # (B, H'·W', C·p·p)
    return x


class AttentionBlock(nn.Module):
    def __init__(self, embed_dim: int, hidden_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        self.layer_norm_1 = nn.LayerNorm(embed_dim)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout)
        self.layer_norm_2 = nn.LayerNorm(embed_dim)
        self.linear = nn.Sequential(
            nn.Linear(embed_dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, embed_dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, B, E), sequence first, as nn.MultiheadAttention expects by default
        inp_x = self.layer_norm_1(x)
        x = x + self.attn(inp_x, inp_x, inp_x)[0]
        x = x + self.linear(self.layer_norm_2(x))
        return x


class VisionTransformer(nn.Module):
    def __init__(self, embed_dim: int, hidden_dim: int, num_channels: int, num_heads: int, num_layers: int,
                 num_classes: int, patch_size: int, num_patches: int, dropout: float = 0.0):
        super().__init__()
        self.patch_size = patch_size
        self.input_layer = nn.Linear(num_channels * patch_size**2, embed_dim)
        self.transformer = nn.Sequential(
            *[AttentionBlock(embed_dim, hidden_dim, num_heads, dropout=dropout) for _ in range(num_layers)]
        )
        self.mlp_head = nn.Sequential(nn.LayerNorm(embed_dim), nn.Linear(embed_dim, num_classes))
        self.dropout = nn.Dropout(dropout)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, 1 + num_patches, embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = img_to_patch(x, self.patch_size)  # (B, T, C·p·p)
        B, T, _ = x.shape
        x = self.input_layer(x)  # (B, T, E)

        cls_token = self.cls_token.repeat(B, 1, 1)
        x = torch.cat([cls_token, x], dim=1)  # (B, T + 1, E)
        x = x + self.pos_embedding[:, : T + 1]

        x = self.dropout(x)
        x = x.transpose(0, 1)  # (T + 1, B, E)
        x = self.transformer(x)

        cls = x[0]  # (B, E)
        return self.mlp_head(cls)

"""The Vision Transformer, read top to bottom: patch embedding, MLP, block, config, model.

Parameter names are timm's, so timm checkpoints load as they are. Tokens are (B, N, D) with the
prefix tokens (CLS) first, then the patches of an h x w grid in row-major order.

This file is plain PyTorch. `vitscope.kernels.apply(model)` (or `create_model(..., kernels=True)`)
swaps in vitscope's CPU kernels afterwards, without touching the parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch
from einops import rearrange
from torch import Tensor, nn

from vitscope.attention import MultiHeadAttention
from vitscope.conv_stem import STEM_ACTS, ConvStem
from vitscope.errors import ConfigError, InputError
from vitscope.fields import check_types
from vitscope.param_groups import param_groups
from vitscope.positional import resample_pos_embed, sincos_2d
from vitscope.residual import DropPath, LayerScale


def _pair(x) -> tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, (tuple, list)) else (int(x), int(x))


class PatchEmbed(nn.Module):
    """Cut the image into P x P patches and project each: a conv with stride = kernel = P.

    With a conv stem the stem's total stride s is taken out of the patch: proj has kernel P / s.
    """

    def __init__(self, img_size, patch_size: int, in_chans: int, embed_dim: int,
                 stem: list[tuple[int, int]] | None = None, stem_act: str = "gelu"):
        super().__init__()
        self.img_size, self.patch_size, self.in_chans = _pair(img_size), int(patch_size), in_chans
        self.stem = ConvStem(in_chans, stem, stem_act) if stem else None
        stride = self.stem.stride if self.stem else 1
        if patch_size % stride:
            raise ConfigError(f"patch_size {patch_size} is not a multiple of the stem's stride {stride}")
        k = patch_size // stride
        self.proj = nn.Conv2d(self.stem.out_chans if self.stem else in_chans, embed_dim, k, k)
        self.grid_size = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)

    def check(self, x: Tensor) -> tuple[int, int]:
        """The patch grid (h, w) of images x (B, C, H, W), or a ValueError that says what is wrong."""
        if x.ndim != 4:
            raise InputError(f"expected images (B, C, H, W), got a tensor of shape {tuple(x.shape)}")
        _, c, h, w = x.shape
        if c != self.in_chans:
            raise InputError(f"the model takes {self.in_chans}-channel images, got {c} channels "
                             f"(input of shape {tuple(x.shape)})")
        p = self.patch_size
        if h % p or w % p:
            raise InputError(f"image size {h}x{w} is not a multiple of the patch size {p}; "
                             f"resize or crop to e.g. {h - h % p or p}x{w - w % p or p}")
        return h // p, w // p

    def forward(self, x: Tensor) -> Tensor:
        self.check(x)
        if self.stem is not None:
            x = self.stem(x)
        return rearrange(self.proj(x), "b d h w -> b (h w) d")  # (B, N, D)


class Mlp(nn.Module):
    """fc1 -> GELU -> fc2, the transformer's position-wise feed-forward network."""

    def __init__(self, dim: int, hidden: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm encoder block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, *, qkv_bias: bool = True,
                 qk_norm: bool = False, proj_drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0, init_values: float | None = None, norm_eps: float = 1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = MultiHeadAttention(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                       attn_drop=attn_drop, proj_drop=proj_drop, norm_eps=norm_eps)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path)

    def forward(self, x: Tensor, *, queries: int | None = None) -> Tensor:
        """x (B, N, D) -> (B, N, D); with `queries=n` the first n tokens' outputs alone, (B, n, D): every token is
        still a key and value, so a head that reads the class token alone needs no more of the last block."""
        return self.forward_normed(x, self.layer_norm(self.norm1, x, self.attn), queries=queries)[0]

    def forward_normed(self, x: Tensor, h: Tensor, *, queries: int | None = None,
                       following: Block | None = None) -> tuple[Tensor, Tensor | None]:
        """The block from x and h = norm1(x), which a loop over blocks may have from the block before:
        x + attn(h), then x + mlp(norm2(x)). Returns the output and, given `following` (the next block),
        following.norm1 of it (else None)."""
        x = x if queries is None else x[:, :queries]
        x, h = self.add_norm(x, self.attn(h, queries=queries), self.ls1, self.drop_path1, self.norm2, self.mlp)
        norm, reader = (None, None) if following is None else (following.norm1, following.attn)
        return self.add_norm(x, self.mlp(h), self.ls2, self.drop_path2, norm, reader)

    # The two seams vitscope.kernels overrides (FastBlock): a residual add with the norm that reads its sum in one
    # pass, and a norm that writes what its reader's first linear layer reads.
    def add_norm(self, x: Tensor, branch: Tensor, ls: nn.Module, drop_path: nn.Module, norm: nn.Module | None,
                 reader: nn.Module | None) -> tuple[Tensor, Tensor | None]:
        """x + drop_path(ls(branch)), and norm of that sum for `reader` (None without a norm)."""
        x = x + drop_path(ls(branch))
        return x, None if norm is None else self.layer_norm(norm, x, reader)

    def layer_norm(self, norm: nn.Module, x: Tensor, reader: nn.Module) -> Tensor:
        """norm(x), which `reader` (an attention or an MLP) reads next."""
        return norm(x)


@dataclass
class ViTConfig:
    """Everything that decides a ViT's shape and regularisation; names follow timm's arguments."""

    img_size: int | tuple[int, int] = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    qk_norm: bool = False
    class_token: bool = True
    global_pool: Literal["token", "avg"] = "token"
    pos_embed: Literal["learn", "sincos2d", "none"] = "learn"
    # How a learned table is resampled for another image size: bicubic with antialias is timm's
    # rule; transformers' `interpolate_pos_encoding` uses plain bicubic (different weights even when
    # upsampling), so models converted from transformers set this False to match it exactly.
    pos_embed_antialias: bool = True
    fc_norm: bool | None = None  # None: timm's rule, a LayerNorm after pooling iff global_pool == "avg"
    init_values: float | None = None  # layer scale
    drop_rate: float = 0.0  # before the head
    pos_drop_rate: float = 0.0
    proj_drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    norm_eps: float = 1e-6
    stem: list[tuple[int, int]] = field(default_factory=list)  # conv stem: (channels, stride) per layer
    stem_act: Literal["gelu", "relu"] = "gelu"  # the stem's activation

    def __post_init__(self):
        check_types(self)  # --set depth=abc or a JSON string otherwise fails deep in the model
        if self.global_pool not in ("token", "avg"):
            raise ConfigError(f"global_pool must be 'token' or 'avg', got {self.global_pool!r}")
        if self.global_pool == "token" and not self.class_token:
            raise ConfigError("global_pool='token' needs class_token=True; use global_pool='avg' without one")
        if self.pos_embed not in ("learn", "sincos2d", "none"):
            raise ConfigError(f"pos_embed must be 'learn', 'sincos2d' or 'none', got {self.pos_embed!r}")
        if self.embed_dim % self.num_heads:
            raise ConfigError(f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}")
        h, w = _pair(self.img_size)
        if h % self.patch_size or w % self.patch_size:
            raise ConfigError(f"img_size {h}x{w} is not a multiple of patch_size {self.patch_size}")
        self.stem = [tuple(s) for s in self.stem]
        if self.stem_act not in STEM_ACTS:
            raise ConfigError(f"stem_act must be one of {sorted(STEM_ACTS)}, got {self.stem_act!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stem"] = [list(s) for s in self.stem]
        d["img_size"] = list(d["img_size"]) if isinstance(d["img_size"], tuple) else d["img_size"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ViTConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown ViTConfig fields: {sorted(unknown)}")
        d = dict(d)
        if isinstance(d.get("img_size"), list):
            d["img_size"] = tuple(d["img_size"])
        return cls(**d)


class VisionTransformer(nn.Module):
    def __init__(self, config: ViTConfig | None = None, **overrides):
        super().__init__()
        cfg = config or ViTConfig()
        if overrides:
            cfg = ViTConfig.from_dict({**cfg.to_dict(), **overrides})
        self.config = cfg
        d = cfg.embed_dim
        self.num_classes = cfg.num_classes
        self.num_prefix_tokens = 1 if cfg.class_token else 0
        self.global_pool = cfg.global_pool
        self.patch_embed = PatchEmbed(cfg.img_size, cfg.patch_size, cfg.in_chans, d, cfg.stem, cfg.stem_act)
        gh, gw = self.patch_embed.grid_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.class_token else None
        if cfg.pos_embed == "learn":
            self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + gh * gw, d))
        else:
            self.pos_embed = None
        self.pos_drop = nn.Dropout(cfg.pos_drop_rate)
        # timm's stochastic-depth schedule; on the CPU explicitly so that building under
        # `with torch.device("meta")` (shape-only models) works
        dpr = [x.item() for x in torch.linspace(0, cfg.drop_path_rate, cfg.depth, device="cpu")]
        self.blocks = nn.ModuleList([
            Block(d, cfg.num_heads, cfg.mlp_ratio, qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm,
                  proj_drop=cfg.proj_drop_rate, attn_drop=cfg.attn_drop_rate, drop_path=dpr[i],
                  init_values=cfg.init_values, norm_eps=cfg.norm_eps)
            for i in range(cfg.depth)
        ])
        use_fc_norm = cfg.global_pool == "avg" if cfg.fc_norm is None else cfg.fc_norm
        self.norm = nn.Identity() if use_fc_norm else nn.LayerNorm(d, eps=cfg.norm_eps)
        self.fc_norm = nn.LayerNorm(d, eps=cfg.norm_eps) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(d, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        if cfg.pos_embed == "sincos2d":  # fixed: a buffer, recomputed rather than saved
            self.register_buffer("pos_embed_fixed", self._sincos(gh, gw), persistent=False)
        self._pos_cache: dict = {}
        self.init_weights()

    # -- set-up ---------------------------------------------------------------------------------
    def init_weights(self) -> None:
        """timm's default ("jax"-free) init: truncated normal 0.02 for matrices and tables."""
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """A new head for `num_classes` (0: none, the model returns the pooled features), initialised as a
        new model's, on the model's device and dtype; the config follows, so checkpoints record it (timm's
        method of the same name)."""
        if num_classes < 0:
            raise ConfigError(f"num_classes must be 0 (no head) or more, got {num_classes}")
        ref = next(self.parameters())
        self.head = nn.Identity()
        if num_classes:
            self.head = nn.Linear(self.config.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
        self.num_classes = num_classes
        self.config = replace(self.config, num_classes=num_classes)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    # -- tokens ---------------------------------------------------------------------------------
    def _sincos(self, gh: int, gw: int) -> Tensor:
        pos = sincos_2d(gh, gw, self.config.embed_dim)[None]  # (1, gh·gw, D)
        return torch.cat([pos.new_zeros(1, self.num_prefix_tokens, pos.shape[-1]), pos], dim=1)

    def _pos_for_grid(self, gh: int, gw: int, ref: Tensor) -> Tensor | None:
        """Position embedding (1, P + gh·gw, D) for the grid at hand (prefix rows zero for sincos).

        The trained grid uses the table (or the fixed buffer) as it is; another grid resamples the
        learned table (cached while no gradient is needed) or computes its sin-cos (cached).
        """
        cfg = self.config
        if cfg.pos_embed == "none":
            return None
        if (gh, gw) == self.patch_embed.grid_size:
            return self.pos_embed if cfg.pos_embed == "learn" else self.pos_embed_fixed.to(ref.dtype)
        if cfg.pos_embed == "sincos2d":
            key = (gh, gw, ref.device, ref.dtype)
            if key not in self._pos_cache:
                self._pos_cache[key] = self._sincos(gh, gw).to(ref)
            return self._pos_cache[key]
        key = (gh, gw, ref.device, ref.dtype, self.pos_embed._version)
        if not torch.is_grad_enabled() and key in self._pos_cache:
            return self._pos_cache[key]
        pos = resample_pos_embed(self.pos_embed, (gh, gw), self.patch_embed.grid_size,
                                 num_prefix_tokens=self.num_prefix_tokens, antialias=cfg.pos_embed_antialias)
        if not torch.is_grad_enabled():
            if len(self._pos_cache) > 16:
                self._pos_cache.clear()
            self._pos_cache[key] = pos
        return pos

    def embed(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> tokens (B, P + h·w, D) with positions added."""
        gh, gw = self.patch_embed.check(x)
        x = self.patch_embed(x)  # (B, h·w, D)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        pos = self._pos_for_grid(gh, gw, x)
        if pos is not None:
            x = x + pos
        # contiguous (a copy only where no class token was concatenated on): every residual add keeps its input's
        # memory layout, so the patch embedding's transposed view would reach each LayerNorm, which copies it first
        return self.pos_drop(x.contiguous())

    # -- the model API (timm's) -----------------------------------------------------------------
    def forward_features(self, x: Tensor) -> Tensor:
        """All tokens after the last block and the final norm: (B, N, D)."""
        return self.norm(self.run_blocks(self.embed(x)))

    def run_blocks(self, x: Tensor, *, last_queries: int | None = None) -> Tensor:
        """The encoder: every block in turn, (B, N, D) -> (B, N, D); with `last_queries=n` the last block computes
        the first n tokens' outputs alone, (B, n, D) (Block.forward's `queries`)."""
        for i, block in enumerate(self.blocks):
            last = i == len(self.blocks) - 1
            x = block(x, queries=last_queries) if last and last_queries is not None else block(x)
        return x

    def pool(self, x: Tensor) -> Tensor:
        if self.global_pool == "avg":
            return x[:, self.num_prefix_tokens:].mean(dim=1)
        return x[:, 0]

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.head_drop(self.fc_norm(self.pool(x)))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> logits (B, num_classes), or pooled features where num_classes is 0."""
        return self.forward_head(self.head_tokens(x))

    def head_tokens(self, x: Tensor) -> Tensor:
        """The tokens `forward_head` reads: every token of `forward_features` (a fast path may compute fewer, where
        the head reads the class token alone)."""
        return self.forward_features(x)

    def forward_intermediates(self, x: Tensor, indices: int | list[int] | None = None, *, norm: bool = False,
                              output_fmt: Literal["NLC", "NCHW"] = "NLC", intermediates_only: bool = False,
                              return_prefix_tokens: bool = False):
        """Tokens after chosen blocks. `indices`: block numbers, or an int n for the last n blocks.

        Returns (final features, [intermediates]) or only the list. With NCHW, prefix tokens are
        dropped from the maps (and returned beside them with `return_prefix_tokens`).
        """
        depth = len(self.blocks)
        if indices is None:
            take = list(range(depth))
        elif isinstance(indices, int):
            take = list(range(depth - indices, depth))
        else:
            take = [i % depth for i in indices]
        gh, gw = self.patch_embed.check(x)
        x = self.embed(x)
        out = []
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in take:
                y = self.norm(x) if norm else x
                if output_fmt == "NCHW":
                    prefix, y = y[:, : self.num_prefix_tokens], y[:, self.num_prefix_tokens:]
                    y = rearrange(y, "b (h w) d -> b d h w", h=gh, w=gw)
                    y = (y, prefix) if return_prefix_tokens else y
                out.append(y)
        if intermediates_only:
            return out
        return self.norm(x), out

    def num_params(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay on matrices only, never on norms, biases, tokens or position tables."""
        return param_groups(self, weight_decay)

"""The Vision Transformer, read top to bottom: patch embedding, MLP, block, config, model.

Parameter names are timm's, so timm checkpoints load as they are. Tokens are (B, N, D) with the
prefix tokens (CLS) first, then the patches of an h x w grid in row-major order.
"""

from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from vitscope import (
    fused_add_norm,
    fused_bn_gelu,
    fused_conv,
    fused_gelu,
    fused_layer_norm,
    fused_linear,
    fused_mlp,
    fused_residual,
)
from vitscope.attention import MultiHeadAttention
from vitscope.fused_linear import Linear
from vitscope.positional import resample_pos_embed, sincos_2d


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _has_global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)


def _pair(x) -> tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, (tuple, list)) else (int(x), int(x))


STEM_ACTS = {"gelu": fused_gelu.GELU, "relu": nn.ReLU}  # fused_gelu.GELU: nn.GELU, from a table in bfloat16


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

    def forward(self, x: Tensor) -> Tensor:
        """The modules in order; each BatchNorm with the GELU after it in one kernel where
        vitscope/fused_bn_gelu.py allows and no hook could see between them, and in training each
        conv's weight gradient from vitscope's kernel where vitscope/fused_conv.py allows."""
        mods, i = list(self), 0
        while i < len(mods):
            if (i + 1 < len(mods) and fused_bn_gelu.fusable(x, mods[i], mods[i + 1])
                    and not (_has_hooks(mods[i]) or _has_hooks(mods[i + 1]) or _has_global_hooks())):
                x, i = fused_bn_gelu.bn_gelu(x, mods[i]), i + 2
            elif fused_conv.fusable(x, mods[i]) and not (_has_hooks(mods[i]) or _has_global_hooks()):
                x, i = fused_conv.conv2d(x, mods[i]), i + 1
            else:
                x, i = mods[i](x), i + 1
        return x


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
            raise ValueError(f"patch_size {patch_size} is not a multiple of the stem's stride {stride}")
        k = patch_size // stride
        self.proj = nn.Conv2d(self.stem.out_chans if self.stem else in_chans, embed_dim, k, k)
        self.grid_size = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        if self.stem is not None:
            # Channels-last weights and inputs: oneDNN runs the stem's convs faster so, 7% off the quick
            # model's bfloat16 training step on CPU (benchmarks/ab_stem_layout.py). Both must be
            # channels-last; the input alone gained nothing. load_state_dict keeps this layout.
            self.to(memory_format=torch.channels_last)

    def check(self, x: Tensor) -> tuple[int, int]:
        if x.ndim != 4:
            raise ValueError(f"expected images (B, C, H, W), got a tensor of shape {tuple(x.shape)}")
        _, c, h, w = x.shape
        if c != self.in_chans:
            raise ValueError(f"the model takes {self.in_chans}-channel images, got {c} channels "
                             f"(input of shape {tuple(x.shape)})")
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {p}; "
                             f"resize or crop to e.g. {h - h % p or p}x{w - w % p or p}")
        return h // p, w // p

    def forward(self, x: Tensor) -> Tensor:
        self.check(x)
        w, b = self.proj.weight, self.proj.bias
        plain_conv = type(self.proj) is nn.Conv2d and not (_has_hooks(self.proj) or _has_global_hooks())
        if self.stem is None and plain_conv and fused_linear.fusable(x, w, b):
            # bfloat16: the stride-P conv is a linear map of each flattened patch; oneDNN's fused
            # linear runs it 2-3x faster than its conv, with the same weights (fused_linear.py)
            p = self.patch_size
            patches = rearrange(x.to(torch.bfloat16), "b c (h p) (w q) -> b (h w) (c p q)", p=p, q=p)
            return fused_linear.linear(patches, w.reshape(w.shape[0], -1), b)  # (B, N, D)
        if self.stem is not None:
            # (B, C, H, W) with (B, H, W, C) memory, like the weights; the flatten below is then a view
            x = self.stem(x.contiguous(memory_format=torch.channels_last))
        return rearrange(self.proj(x), "b d h w -> b (h w) d")


_EXACT_GELUS = (nn.GELU, fused_gelu.GELU)  # the activations the fused MLP paths may stand in for


class Mlp(nn.Module):
    """fc1, GELU, fc2. In bfloat16 inference on CPU, fc1's bias runs inside its matmul and the GELU in
    it or in a table pass right after (vitscope/fused_linear.py); in bfloat16 training the MLP keeps
    GELU's derivative instead of its input (vitscope/fused_mlp.py), and so does float32 training on
    fused_linear's float32 path (AMD CPUs without AVX-512; in float32 inference fc1's product with the GELU in
    its pass measured 0.96x the GELU kernel's own pass). Either only where nothing could observe fc1's, the
    GELU's or fc2's calls."""

    def __init__(self, dim: int, hidden: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = Linear(dim, hidden)
        self.act = fused_gelu.GELU()  # nn.GELU, in vitscope's float32 kernel on CPUs without AVX-512
        self.drop1 = nn.Dropout(drop)
        self.fc2 = Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)

    def _gelu_fusable(self, x: Tensor) -> bool:
        inner = (self.fc1, self.act, self.drop1)
        return (type(self.act) in _EXACT_GELUS and self.act.approximate == "none" and type(self.fc1) is Linear
                and not (self.drop1.training and self.drop1.p > 0)
                and fused_linear.fusable(x, self.fc1.weight, self.fc1.bias)
                and not fused_linear.needs_grad(x, self.fc1.weight, self.fc1.bias)
                and not any(_has_hooks(m) for m in inner) and not _has_global_hooks())

    def _training_fusable(self, x: Tensor) -> bool:
        inner = (self.fc1, self.act, self.drop1, self.fc2)
        return (type(self.act) in _EXACT_GELUS and self.act.approximate == "none" and type(self.fc1) is Linear
                and type(self.fc2) is Linear and not (self.drop1.training and self.drop1.p > 0)
                and fused_mlp.fusable(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
                and not any(_has_hooks(m) for m in inner) and not _has_global_hooks())

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cpu and self._gelu_fusable(x):  # x.is_cpu first: the kernels are for CPUs, and on a GPU the
            #                                      checks would only cost its host time
            return self.drop2(self.fc2(fused_linear.linear(x, self.fc1.weight, self.fc1.bias, gelu=True)))
        if x.is_cpu and self._training_fusable(x):
            return self.drop2(fused_mlp.mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias))
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


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

    @staticmethod
    def _norm_fusable(norm: nn.Module, consumer: nn.Module) -> bool:
        """Whether norm's output may go straight to bfloat16 for `consumer` (vitscope's attention or MLP,
        whose first linear layer would cast it): nothing hooked could see the difference."""
        first = getattr(consumer, "fc1" if type(consumer) is Mlp else "qkv", None)  # the layer that reads it
        return (type(consumer) in (MultiHeadAttention, Mlp) and type(first) is Linear
                and not (_has_hooks(norm) or _has_hooks(consumer) or _has_hooks(first) or _has_global_hooks()))

    def _norm(self, norm: nn.Module, x: Tensor, consumer: nn.Module) -> Tensor:
        """norm(x); under bfloat16 autocast, straight to the bfloat16 that `consumer`'s linear layer would
        cast it to (vitscope/fused_layer_norm.py), where nothing hooked could see the difference."""
        if x.is_cpu and fused_layer_norm.fusable(x, norm) and self._norm_fusable(norm, consumer):
            return fused_layer_norm.layer_norm(x, norm)
        return norm(x)

    @staticmethod
    def _plain_residual(ls: nn.Module, drop_path: DropPath) -> bool:
        """Whether the residual's branch goes in as it is: no LayerScale, no stochastic depth, nothing hooked."""
        return type(ls) is nn.Identity and (drop_path.p == 0.0 or not drop_path.training) and not _has_hooks(drop_path)

    @staticmethod
    def _residual(x: Tensor, branch: Tensor, ls: nn.Module, drop_path: DropPath, *, own_x: bool = False) -> Tensor:
        """x + drop_path(ls(branch)); a bfloat16 branch with neither is added in one pass
        (vitscope/fused_residual.py), into x itself where `own_x` (nothing else holds x) and autograd
        records nothing."""
        if x.is_cpu and Block._plain_residual(ls, drop_path) and fused_residual.fusable(x, branch):
            if own_x and not _records(x, branch):
                return fused_residual.add_(x, branch)
            return fused_residual.add(x, branch)
        return x + drop_path(ls(branch))

    @staticmethod
    def _add_norm(x: Tensor, branch: Tensor, ls: nn.Module, drop_path: DropPath, norm: nn.Module,
                  consumer: nn.Module, *, own_x: bool = False) -> tuple[Tensor, Tensor] | None:
        """(x + branch, norm of it in bfloat16 for `consumer`) in one pass (vitscope/fused_add_norm.py) where
        the residual and the norm would both run vitscope's kernels and nothing hooked could see the sum's
        float32 LayerNorm, the sum written into x itself where `own_x` and autograd records nothing; else
        None."""
        if (x.is_cpu and Block._plain_residual(ls, drop_path) and Block._norm_fusable(norm, consumer)
                and fused_add_norm.fusable(x, branch, norm)):
            out = x if own_x and not _records(x, branch) else None
            return fused_add_norm.add_layer_norm(x, branch, norm, out=out)
        return None

    def forward(self, x: Tensor, *, queries: int | None = None) -> Tensor:
        """x (B, N, D) -> (B, N, D); with `queries=n`, only the first n tokens' outputs, (B, n, D)."""
        return self.forward_chained(x, None, None, queries=queries)[0]

    def forward_chained(self, x: Tensor, normed: Tensor | None, following: Block | None, *,
                        queries: int | None = None) -> tuple[Tensor, Tensor | None]:
        """`forward` for a model's loop over blocks nothing hooks: `normed` is norm1(x) in bfloat16 where the
        block before computed it (else None); with `following` (the next block) the last residual add and
        following.norm1 run in one pass where both would run vitscope's kernels. Returns (the output,
        following.norm1 of it in bfloat16, or None)."""
        attn = self.attn(self._norm(self.norm1, x, self.attn) if normed is None else normed, queries=queries)
        x = x if queries is None else x[:, :queries]
        fused = self._add_norm(x, attn, self.ls1, self.drop_path1, self.norm2, self.mlp)
        if fused is None:
            x = self._residual(x, attn, self.ls1, self.drop_path1)
            h = self._norm(self.norm2, x, self.mlp)
        else:
            x, h = fused  # x + attn is this block's own tensor: the next sum may go into it
        mlp = self.mlp(h)
        if following is not None:
            chained = self._add_norm(x, mlp, self.ls2, self.drop_path2, following.norm1, following.attn,
                                     own_x=fused is not None)
            if chained is not None:
                return chained
        return self._residual(x, mlp, self.ls2, self.drop_path2, own_x=fused is not None), None


def _records(*ts: Tensor) -> bool:
    """Whether autograd records an op on these tensors now."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


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
        self._check_scalar_types()
        if self.global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {self.global_pool!r}")
        if self.global_pool == "token" and not self.class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' without one")
        if self.pos_embed not in ("learn", "sincos2d", "none"):
            raise ValueError(f"pos_embed must be 'learn', 'sincos2d' or 'none', got {self.pos_embed!r}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}")
        h, w = _pair(self.img_size)
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"img_size {h}x{w} is not a multiple of patch_size {self.patch_size}")
        self.stem = [tuple(s) for s in self.stem]
        if self.stem_act not in STEM_ACTS:
            raise ValueError(f"stem_act must be one of {sorted(STEM_ACTS)}, got {self.stem_act!r}")

    def _check_scalar_types(self) -> None:
        """Numbers and switches of the right kind (`--set depth=abc` or a JSON string otherwise fails deep in
        the model's construction); an int passes as a float, a bool never as a number."""
        hints = typing.get_type_hints(type(self))
        for name, tp in hints.items():
            args = set(typing.get_args(tp)) or {tp}
            value = getattr(self, name)
            if value is None and type(None) in args:
                continue
            kinds = [k for k in (bool, int, float) if k in args]
            if not kinds or not args <= {bool, int, float, type(None)}:
                continue  # img_size, stem and the Literal strings are checked on their own
            ok = isinstance(value, bool) if kinds == [bool] else (
                not isinstance(value, bool) and isinstance(value, (int, float) if float in kinds else int))
            if not ok:
                want = {bool: "true or false", int: "a whole number", float: "a number"}[kinds[-1]]
                raise ValueError(f"{name} must be {want}{' or null' if type(None) in args else ''}, got {value!r}")

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
            raise ValueError(f"unknown ViTConfig fields: {sorted(unknown)}")
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
        self.head = Linear(d, cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
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
            raise ValueError(f"num_classes must be 0 (no head) or more, got {num_classes}")
        ref = next(self.parameters())
        self.head = nn.Identity()
        if num_classes:
            self.head = Linear(self.config.embed_dim, num_classes, device=ref.device, dtype=ref.dtype)
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
        return self.pos_drop(x)

    # -- the model API (timm's) -----------------------------------------------------------------
    def _chainable(self) -> bool:
        """Whether the loop over blocks may chain them (Block.forward_chained): every block a vit.Block and
        nothing hooked on them, so no one sees a block called other than as a module."""
        return all(type(b) is Block and not _has_hooks(b) for b in self.blocks) and not _has_global_hooks()

    def _run_blocks(self, x: Tensor, last_queries: int | None = None) -> Tensor:
        """x through every block, the last with `queries=last_queries`. Where every block is a vit.Block and
        nothing is hooked on them, each block's last residual add and the next one's norm1 share a pass
        (Block.forward_chained); otherwise each block is called as a module."""
        blocks = list(self.blocks)
        if not self._chainable():
            for i, block in enumerate(blocks):
                x = block(x, queries=last_queries) if i == len(blocks) - 1 and last_queries else block(x)
            return x
        normed = None
        for i, block in enumerate(blocks):
            last = i == len(blocks) - 1
            x, normed = block.forward_chained(x, normed, None if last else blocks[i + 1],
                                              queries=last_queries if last else None)
        return x

    def forward_features(self, x: Tensor) -> Tensor:
        """All tokens after the last block and the final norm: (B, N, D)."""
        return self.norm(self._run_blocks(self.embed(x)))

    def pool(self, x: Tensor) -> Tensor:
        if self.global_pool == "avg":
            return x[:, self.num_prefix_tokens:].mean(dim=1)
        return x[:, 0]

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.head_drop(self.fc_norm(self.pool(x)))
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        if not self._only_class_token_read():
            return self.forward_head(self.forward_features(x))
        # The head reads the class token alone, so the last block computes that one token's output
        # (all tokens are still its keys and values): the same logits for 1/8 fewer FLOPs at depth 6.
        x = self._run_blocks(self.embed(x), last_queries=1)  # (B, 1, D)
        return self.forward_head(self.norm(x))

    def _only_class_token_read(self) -> bool:
        """True when nothing but the head sees the last block's output: token pooling, and no capture
        or hook on the last block or the final norm that would expect every token."""
        if self.global_pool != "token" or not len(self.blocks):
            return False
        last = self.blocks[-1]
        if last.attn.capture is not None or _has_global_hooks():
            return False
        return not any(_has_hooks(m) for m in (*last.modules(), *self.norm.modules()))

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
        skip = self.no_weight_decay()
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


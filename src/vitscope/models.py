"""Named presets: a preset is a registered function returning a ViTConfig, never a copied file.

`create_model(name, **overrides)` builds one; `list_models()` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vitscope.errors import ConfigError
from vitscope.kernels import apply
from vitscope.vit import VisionTransformer, ViTConfig
from vitscope.weights.pretrained import load_pretrained, weights_file

_REGISTRY: dict[str, Callable[[], ViTConfig]] = {}


def register(fn: Callable[[], ViTConfig]) -> Callable[[], ViTConfig]:
    _REGISTRY[fn.__name__] = fn
    return fn


def list_models(pattern: str = "*") -> list[str]:
    import fnmatch

    return sorted(n for n in _REGISTRY if fnmatch.fnmatch(n, pattern))


def get_config(name: str, **overrides) -> ViTConfig:
    if name not in _REGISTRY:
        import difflib

        close = difflib.get_close_matches(name, _REGISTRY, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown model {name!r}.{hint} See `vitscope models` for the list.")
    cfg = _REGISTRY[name]()
    if overrides:
        cfg = ViTConfig.from_dict({**cfg.to_dict(), **overrides})
    return cfg


def create_model(name: str, pretrained: bool | str | Path = False, *, kernels: bool = False,
                 **overrides) -> VisionTransformer:
    """Build a preset, e.g. create_model("vit_base_patch16_224", num_classes=10).

    `kernels=True` swaps vitscope's CPU kernels in (vitscope.kernels.apply); without it the model is plain
    PyTorch.

    `pretrained=True` loads timm's pretrained weights for the ImageNet presets (downloaded once, see
    vitscope.weights.pretrained), `pretrained=PATH` a timm checkpoint file; overrides such as num_classes, in_chans
    and img_size adapt them as timm does."""
    model = VisionTransformer(get_config(name, **overrides))
    if pretrained is not False and pretrained is not None:
        load_pretrained(model, weights_file(name) if pretrained is True else Path(pretrained))
    if kernels:
        apply(model)
    return model


# -- the original paper's shapes (224 x 224 RGB, patch 16, 1000 classes) --------------------------
@register
def vit_tiny_patch16_224() -> ViTConfig:
    return ViTConfig(embed_dim=192, depth=12, num_heads=3)


@register
def vit_small_patch16_224() -> ViTConfig:
    return ViTConfig(embed_dim=384, depth=12, num_heads=6)


@register
def vit_base_patch16_224() -> ViTConfig:
    """ViT-B/16: 86,567,656 parameters with the 1000-class head."""
    return ViTConfig(embed_dim=768, depth=12, num_heads=12)


@register
def vit_large_patch16_224() -> ViTConfig:
    return ViTConfig(embed_dim=1024, depth=24, num_heads=16)


# -- the tutorials' ViT: 144 x 144 RGB (Oxford-IIIT Pet, 37 classes) ------------------------------
@register
def seed_vit() -> ViTConfig:
    """The tutorials' model: patch 4, width 32, 6 layers, 2 heads, MLP width 32, 37 classes."""
    return ViTConfig(img_size=144, patch_size=4, in_chans=3, num_classes=37, embed_dim=32, depth=6,
                     num_heads=2, mlp_ratio=1.0)


# -- 28 x 28 single-channel images (Fashion-MNIST, MNIST) -----------------------------------------
@register
def vit_tiny_patch4_28() -> ViTConfig:
    """A plain small ViT for 28 x 28 grayscale: patch 4 (7 x 7 = 49 tokens), width 128, 6 layers."""
    return ViTConfig(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=128, depth=6,
                     num_heads=4, mlp_ratio=2.0)


@register
def vit_tiny_patch7_28() -> ViTConfig:
    """Patch 7 (4 x 4 = 16 tokens), width 128, 6 layers: fewer, richer tokens."""
    return ViTConfig(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=128, depth=6,
                     num_heads=4, mlp_ratio=2.0)


@register
def vit_fmnist_quick() -> ViTConfig:
    """The README's default: a small hybrid ViT for 28 x 28 grayscale (see recipes.fmnist_quick).

    Five 3x3 convs (32 channels at 28 x 28, 64 twice at 14 x 14, 128 twice at 7 x 7) turn the image
    into a 7 x 7 map whose cells are the 49 tokens (patch 4 over a stride-4 stem: a 1 x 1
    projection), width 128, through 2 blocks; 2-D sin-cos positions and average pooling. The stem
    does the local work cheaply, so the attention blocks start from tokens worth more: at three
    epochs this reaches 1.2 points more than three convs and 3 blocks, in about the same time.
    """
    return ViTConfig(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=128, depth=2,
                     num_heads=4, mlp_ratio=2.0, stem=[(32, 1), (64, 2), (64, 1), (128, 2), (128, 1)],
                     class_token=False, global_pool="avg", pos_embed="sincos2d")

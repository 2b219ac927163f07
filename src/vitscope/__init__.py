"""vitscope: attention and Vision Transformers from first principles.

The public names below load on first use (PEP 562), so `import vitscope` does not import torch: the command
line starts, and answers Ctrl-C with one line, before the seconds torch takes to load.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AdditiveAttention": "vitscope.attention",
    "KVCache": "vitscope.attention",
    "MultiHeadAttention": "vitscope.attention",
    "SpatialSelfAttention": "vitscope.attention",
    "attend": "vitscope.attention",
    "dot_product_attention": "vitscope.attention",
    "key_padding_mask": "vitscope.attention",
    "create_model": "vitscope.models",
    "list_models": "vitscope.models",
    "VisionTransformer": "vitscope.vit",
    "ViTConfig": "vitscope.vit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:  # a subpackage or module, as `vitscope.kernels` after `import vitscope`
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'vitscope' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

"""vitscope: attention and Vision Transformers from first principles."""

from vitscope.attention import (
    AdditiveAttention,
    KVCache,
    MultiHeadAttention,
    SpatialSelfAttention,
    attend,
    dot_product_attention,
    key_padding_mask,
)
from vitscope.models import create_model, list_models
from vitscope.vit import VisionTransformer, ViTConfig

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention", "KVCache", "MultiHeadAttention", "SpatialSelfAttention", "ViTConfig",
    "VisionTransformer", "attend", "create_model", "dot_product_attention", "key_padding_mask",
    "list_models",
]

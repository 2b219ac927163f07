"""Which fast class stands in for which plain one, and the swap both ways: the one place `vitscope.kernels.apply`
and `revert` read."""

from __future__ import annotations

from torch import nn

from vitscope.attention import MultiHeadAttention
from vitscope.conv_stem import ConvStem
from vitscope.decoder import TransformerDecoder
from vitscope.kernels.fast_decoder import FastTransformerDecoder
from vitscope.kernels.fused_gelu import GELU
from vitscope.kernels.fused_linear import Linear
from vitscope.kernels.guards import DecidesOnSwap
from vitscope.kernels.modules import FastAttention, FastBlock, FastConvStem, FastMlp, FastPatchEmbed, FastViT
from vitscope.vit import Block, Mlp, PatchEmbed, VisionTransformer

# Each plain class and the class that stands in for it; only exact types are swapped, so a user's
# subclass keeps its own forward.
SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: Linear, nn.GELU: GELU, Mlp: FastMlp, MultiHeadAttention: FastAttention, Block: FastBlock,
    ConvStem: FastConvStem, PatchEmbed: FastPatchEmbed, VisionTransformer: FastViT,
    TransformerDecoder: FastTransformerDecoder,
}
PLAIN = {fast: plain for plain, fast in SWAPS.items() if fast is not plain}


def swap_in(model: nn.Module) -> nn.Module:
    """Swap the fast classes into `model` in place (children before parents, so each parent decides with
    its children's final types) and return it."""
    for m in reversed(list(model.modules())):
        m.__class__ = SWAPS.get(type(m), type(m))
        if isinstance(m, DecidesOnSwap):  # decided again where applied twice
            m._decide()
            m._decided = True
    return model


def swap_out(model: nn.Module) -> nn.Module:
    """Give every module of `model` its plain class back, in place, and return it."""
    for m in model.modules():
        plain = PLAIN.get(type(m))
        if plain is not None:
            if hasattr(m, "_undecide"):
                m._undecide()
            m.__dict__.pop("_decided", None)
            m.__class__ = plain
    return model

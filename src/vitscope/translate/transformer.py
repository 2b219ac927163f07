"""The transformer translator: a pre-norm encoder over the source words, vitscope's TransformerDecoder
cross-attending to it.

    src (B, N) -> embedding + learned positions -> EncoderBlock x depth (padding-masked) -> LayerNorm -> memory
    <bos> y1 y2 ... (B, T) -> TransformerDecoder(masked self-attention, cross-attention over memory) -> logits

The encoder block is the ViT's pre-norm block (vit.Block's layout, with vit.Mlp) with a padding mask passed to its
attention: source sentences differ in length, images do not. Every attention here is
vitscope.attention.MultiHeadAttention. Decoding goes through the steps every TransformerDecoder model inherits
(`vitscope.sequence.steps.DecoderSteps`): key/value caches, one memory row per sentence shared by its beams.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import Tensor, nn

from vitscope.attention import MultiHeadAttention, key_padding_mask
from vitscope.decoder import TransformerDecoder
from vitscope.fields import check_decoder_sizes, check_transformer_shape, check_types
from vitscope.param_groups import param_groups
from vitscope.positional import LearnedPositionalEmbedding
from vitscope.sequence.loss import sequence_losses
from vitscope.sequence.steps import DecoderSteps
from vitscope.sequence.vocab import PAD
from vitscope.vit import Mlp


@dataclass
class TransformerTranslatorConfig:
    src_vocab_size: int
    tgt_vocab_size: int
    dim: int = 128
    depth: int = 2  # encoder blocks, and as many decoder blocks
    num_heads: int = 4
    mlp_ratio: float = 2.0
    drop: float = 0.1
    max_len: int = 42  # target positions, <bos> included
    max_src_len: int = 20  # source positions
    label_smoothing: float = 0.0

    def __post_init__(self):
        check_types(self)
        check_decoder_sizes(self, ("src_vocab_size", "tgt_vocab_size", "dim", "depth", "num_heads", "max_src_len"))
        check_transformer_shape(self)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransformerTranslatorConfig:
        return cls(**d)


class EncoderBlock(nn.Module):
    """Pre-norm encoder block with a padding mask: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, drop: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = MultiHeadAttention(dim, num_heads, proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x (B, N, D), mask (B, 1, 1, N) True at real words -> (B, N, D)."""
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.mlp(self.norm2(x))


class TransformerTranslator(DecoderSteps, nn.Module):
    kind = "transformer"
    has_attention = True

    def __init__(self, config: TransformerTranslatorConfig):
        super().__init__()
        self.config = config
        d = config.dim
        self.src_embed = nn.Embedding(config.src_vocab_size, d)
        self.src_pos = LearnedPositionalEmbedding(config.max_src_len, d)
        self.drop = nn.Dropout(config.drop)
        self.blocks = nn.ModuleList([EncoderBlock(d, config.num_heads, config.mlp_ratio, config.drop)
                                     for _ in range(config.depth)])
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.decoder = TransformerDecoder(config.tgt_vocab_size, d, config.depth, config.num_heads, config.max_len,
                                          mlp_ratio=config.mlp_ratio, drop=config.drop)
        nn.init.trunc_normal_(self.src_embed.weight, std=0.02)
        self.max_len = config.max_len

    def no_weight_decay(self) -> set[str]:
        return {"src_embed.weight", "src_pos.weight", "decoder.token_embed.weight", "decoder.pos_embed.weight"}

    def param_groups(self, weight_decay: float) -> list[dict]:
        return param_groups(self, weight_decay)

    def encode(self, src: Tensor) -> Tensor:
        """src (B, N) word ids, `<pad>` on the right -> memory (B, N, D)."""
        mask = key_padding_mask(padded=src == PAD)  # (B, 1, 1, N)
        x = self.drop(self.src_pos(self.src_embed(src)))
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)

    def forward(self, src: Tensor, tgt: Tensor, *, return_weights: bool = False):
        """Teacher forcing: logits (B, T-1, V) for tgt[:, 1:]; with `return_weights` also every decoder block's
        cross-attention (B, T-1, L, H, N)."""
        memory = self.encode(src)
        return self.decoder(tgt[:, :-1], memory, context_padding_mask=src == PAD, return_weights=return_weights)

    def losses(self, src: Tensor, tgt: Tensor) -> dict[str, Tensor]:
        return sequence_losses(self(src, tgt), tgt, label_smoothing=self.config.label_smoothing)

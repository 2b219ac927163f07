"""The transformer captioner: a ViT encoder's tokens -> a Transformer decoder that cross-attends to them.

    image (B, C, H, W) -> VisionTransformer.forward_features -> memory (B, N, De)
    <bos> w1 w2 ... (B, T) -> TransformerDecoder(masked self-attention, cross-attention over memory)
                           -> logits (B, T, V) for w1 w2 ... <eos>

The encoder is any vitscope preset (`vitscope.models.create_model`), so timm / pretrained weights
load as they do for classification; its classifier head is dropped (num_classes=0) and every token
(class token included, when the preset has one) is the decoder's memory.

Training is teacher forcing: the decoder reads the reference shifted right and predicts it shifted
left; targets that are `<pad>` are left out of the loss (ignore_index). No padding mask is needed on
the decoder's self-attention: captions are padded on the right, so causality already keeps every
real token from seeing the pads after it, and the fused causal kernel stays usable.

Decoding goes one token at a time through `start` / `step` / `extend` / `reorder`, the steps every
TransformerDecoder model inherits from `vitscope.sequence.steps.DecoderSteps` (the translator too), which
`vitscope.sequence.decoding` drives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import Tensor, nn

from vitscope.caption.encoder import EncoderSpec, MemoryPositions, build_encoder, encode_tokens
from vitscope.decoder import TransformerDecoder
from vitscope.fields import check_decoder_sizes, check_transformer_shape, check_types
from vitscope.param_groups import param_groups
from vitscope.sequence.loss import sequence_losses
from vitscope.sequence.steps import DecoderSteps


# -- config and model ------------------------------------------------------------------------------------
@dataclass
class TransformerCaptionerConfig:
    vocab_size: int
    encoder: EncoderSpec = field(default_factory=EncoderSpec)
    dim: int = 256
    depth: int = 3
    num_heads: int = 4
    mlp_ratio: float = 4.0
    max_len: int = 32  # positions, <bos> included: the longest caption decoded or trained
    drop: float = 0.1
    label_smoothing: float = 0.0
    memory_pos: bool = False  # add MemoryPositions to the encoder's tokens

    def __post_init__(self):
        check_types(self)
        check_decoder_sizes(self, ("vocab_size", "dim", "depth", "num_heads"))
        check_transformer_shape(self)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransformerCaptionerConfig:
        d = dict(d)
        d["encoder"] = EncoderSpec(**d.get("encoder", {}))
        return cls(**d)


class TransformerCaptioner(DecoderSteps, nn.Module):
    kind = "transformer"

    def __init__(self, config: TransformerCaptionerConfig):
        super().__init__()
        self.config = config
        e = config.encoder
        self.encoder = build_encoder(e.preset, e.overrides, e.pretrained)
        self.decoder = TransformerDecoder(
            config.vocab_size, config.dim, config.depth, config.num_heads, config.max_len,
            context_dim=self.encoder.config.embed_dim, mlp_ratio=config.mlp_ratio, drop=config.drop,
        )
        self.memory_pos = MemoryPositions(self.encoder) if config.memory_pos else None
        self.max_len = config.max_len
        self.num_prefix_tokens = self.encoder.num_prefix_tokens
        self.grid = self.encoder.patch_embed.grid_size  # (gh, gw) of the image tokens after the prefix

    # -- training --------------------------------------------------------------------------------------
    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {
            "decoder.token_embed.weight", "decoder.pos_embed.weight", "memory_pos.table"}

    def param_groups(self, weight_decay: float) -> list[dict]:
        return param_groups(self, weight_decay)

    def encode(self, images: Tensor) -> Tensor:
        memory = encode_tokens(self.encoder, images)  # (B, N, De)
        return memory if self.memory_pos is None else self.memory_pos(memory)

    def forward(self, images: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None) -> Tensor:
        """Teacher forcing: images (B, C, H, W), tokens (B, T) `<bos>` ... `<eos>` `<pad>`... ->
        logits (B, T-1, V), row t predicting tokens[:, t+1]."""
        return self.teacher_forced(self.encode(images), tokens, memory_padding=memory_padding)

    def teacher_forced(self, memory: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None) -> Tensor:
        """`forward` from an encoded memory (B, N, De): logits (B, T-1, V)."""
        return self.decoder(tokens[:, :-1], memory, context_padding_mask=memory_padding)

    def losses(self, images: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None) -> dict[str, Tensor]:
        """{'loss', 'xent', 'correct', 'targets'}: `vitscope.sequence.sequence_losses` of the teacher-forced
        logits (B, T-1, V), pads left out."""
        return sequence_losses(self(images, tokens, memory_padding=memory_padding), tokens,
                               label_smoothing=self.config.label_smoothing)

    def loss(self, images: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None) -> Tensor:
        return self.losses(images, tokens, memory_padding=memory_padding)["loss"]

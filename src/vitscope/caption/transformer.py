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

Decoding goes one token at a time through `start` / `step` / `reorder` (the interface
`vitscope.caption.decoding` drives for both captioners): with `use_cache` each step feeds only the
newest token and reuses every block's self-attention keys/values and the memory's cross-attention
keys/values; without it each step re-runs the whole prefix. Both give the same logits. An image's
beams share its memory and cross-attention keys/values (one row per image, see vitscope.decoder).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitscope.attention import KVCache
from vitscope.caption.encoder import EncoderSpec, MemoryPositions, build_encoder, encode_tokens
from vitscope.caption.vocab import PAD
from vitscope.decoder import Caches, TransformerDecoder


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups as the ViT's: decay on matrices only, never on norms, biases, or what the model
    lists in `no_weight_decay()` (tokens, position tables, word embeddings)."""
    skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def token_counts(logits: Tensor, tokens: Tensor) -> dict[str, Tensor]:
    """Teacher-forced logits (B, T-1, V) against tokens (B, T): {'correct': the real targets the argmax
    gets right, 'targets': the real (not `<pad>`) targets}, as 0-d int64 tensors."""
    targets = tokens[:, 1:]
    real = targets != PAD
    return {"correct": ((logits.argmax(-1) == targets) & real).sum(), "targets": real.sum()}


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TransformerCaptionerConfig:
        d = dict(d)
        d["encoder"] = EncoderSpec(**d.get("encoder", {}))
        return cls(**d)


@dataclass
class TransformerState:
    """What decoding carries between steps, one row per hypothesis (R = B·K under beam search)."""

    memory: Tensor  # (B, N, De): one row per image, shared by its beams
    memory_padding: Tensor | None  # (B, N) True at padded image tokens
    caches: Caches | None  # per block (self (R, ...), cross (B, ...)) KV caches; None: re-run the prefix
    tokens: Tensor  # (R, t) every token fed so far


class TransformerCaptioner(nn.Module):
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
        """{'loss', 'xent', 'correct', 'targets'}: mean cross-entropy over the real target tokens (pads
        ignored); the last two count the targets the logits' argmax gets right, and the real targets."""
        logits = self(images, tokens, memory_padding=memory_padding)  # (B, T-1, V)
        xent = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), ignore_index=PAD,
                               label_smoothing=self.config.label_smoothing)
        return {"loss": xent, "xent": xent, **token_counts(logits, tokens)}

    def loss(self, images: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None) -> Tensor:
        return self.losses(images, tokens, memory_padding=memory_padding)["loss"]

    def decode_with_attention(self, tokens: Tensor, memory: Tensor, *, caches: Caches | None = None,
                              memory_padding: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The decoder with every block's cross-attention: tokens (R, T) (only the new ones with
        `caches`) -> logits (R, T, V), weights (R, T, L, H, N)."""
        return self.decoder(tokens, memory, context_padding_mask=memory_padding, caches=caches,
                            return_weights=True)

    # -- the step interface (vitscope.caption.decoding) -------------------------------------------------
    def start(self, memory: Tensor, memory_padding: Tensor | None = None, *, use_cache: bool = True,
              bos: int = 1, beams: int = 1) -> TransformerState:
        """`beams` hypotheses per image, one row each (R = B·beams); they all read the image's one
        memory row and its cross-attention keys/values."""
        tokens = torch.full((memory.shape[0] * beams, 1), bos, dtype=torch.long, device=memory.device)
        return TransformerState(memory, memory_padding, self.decoder.new_caches() if use_cache else None, tokens)

    def step(self, state: TransformerState) -> tuple[Tensor, Tensor, TransformerState]:
        """Logits for the token after state.tokens: (R, V), its cross-attention (R, L, H, N)."""
        if state.caches is not None:
            new = state.tokens[:, len(state.caches[0][0]):]  # (R, 1): only what the caches lack
            logits, w = self.decode_with_attention(new, state.memory, caches=state.caches,
                                                   memory_padding=state.memory_padding)
        else:
            logits, w = self.decode_with_attention(state.tokens, state.memory, memory_padding=state.memory_padding)
        return logits[:, -1], w[:, -1], state

    def extend(self, state: TransformerState, token: Tensor) -> TransformerState:
        """Append the chosen token (R,) to every row."""
        state.tokens = torch.cat([state.tokens, token[:, None]], 1)
        return state

    def reorder(self, state: TransformerState, index: Tensor) -> TransformerState:
        """Rows `index` (R,) of the hypotheses, each index within its image's beams: beams reselected.
        Only what differs between beams follows them (the self-attention caches, the tokens); the
        memory and the cross-attention caches stay one row per image."""
        caches = None
        if state.caches is not None:
            caches = [(KVCache(s.k.index_select(0, index), s.v.index_select(0, index)) if s.k is not None
                       else KVCache(), cross) for s, cross in state.caches]
        return TransformerState(state.memory, state.memory_padding, caches, state.tokens.index_select(0, index))

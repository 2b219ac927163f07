"""The lecture's RNN baseline, "Show, Attend and Tell" (Xu et al. 2015), on a vitscope ViT encoder.

At every step the LSTM's previous hidden state scores every image token with additive (Bahdanau)
attention, the weighted sum of the tokens is the context vector, a sigmoid gate computed from the
same hidden state scales it (the paper's beta, sec. 4.2.1, here one per channel where the paper's is one
scalar per step), and the LSTM reads the previous word's embedding with that context:

    alpha_t = softmax_i( v^T tanh(W_h h_{t-1} + W_a a_i) )            (R, N)   AdditiveAttention
    z_t     = sigmoid(f_beta(h_{t-1})) * sum_i alpha_ti a_i            (R, De)
    h_t, c_t = LSTM([E y_{t-1}; z_t], (h_{t-1}, c_{t-1}))
    p(y_t)  = softmax( L_o(dropout(E y_{t-1} + L_h h_t + L_z z_t)) )   the deep output, eq. 7

h_0 and c_0 come from the mean image token through two linear layers (eq. 5). Training adds the
paper's doubly stochastic attention regulariser, lambda * sum_i (1 - sum_t alpha_ti)^2 (eq. 14),
which pushes every image token to be looked at over the caption; sums run over the real caption
steps (not pads) and the real image tokens, and it keeps the paper's weight against the words'
negative log-likelihood (`memory_losses`).

The memory a_i is the encoder's tokens after its last block, or with `memory="stem"` its patch grid
before any block, the local features the paper's CNN gives (caption/encoder.py).

Unlike the transformer, the recurrence runs step by step in training too; `forward` and decoding
call the same `_step`, so teacher-forced logits equal the decoder's step-by-step logits. Training
(`packed`) runs each caption only to its own end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from vitscope.attention import AdditiveAttention
from vitscope.caption.encoder import (
    EncoderSpec,
    MemoryPositions,
    MemorySource,
    build_encoder,
    check_memory_source,
    encode_memory,
    memory_prefix_tokens,
)
from vitscope.errors import ConfigError
from vitscope.fields import check_decoder_sizes, check_types
from vitscope.param_groups import param_groups
from vitscope.sequence.loss import masked_xent, token_counts
from vitscope.sequence.vocab import PAD


@dataclass
class ShowAttendTellConfig:
    vocab_size: int
    encoder: EncoderSpec = field(default_factory=EncoderSpec)
    embed_dim: int = 256
    hidden_dim: int = 512
    attn_dim: int = 256
    max_len: int = 32  # the longest caption decoded, <bos> included (an LSTM has no position table;
    # the limit keeps the two captioners' decoding interfaces alike)
    drop: float = 0.3
    attention_reg: float = 1.0  # lambda of the doubly stochastic regulariser, weighed as in the paper
    label_smoothing: float = 0.0
    memory_pos: bool = False  # add MemoryPositions to the encoder's tokens
    memory: MemorySource = "tokens"  # the encoder's tokens after its last block, or its stem's grid (encoder.py)

    def __post_init__(self):
        check_memory_source(self.memory)  # its own message, naming the sources without quotes
        check_types(self)
        check_decoder_sizes(self, ("embed_dim", "hidden_dim", "attn_dim", "vocab_size"))
        if not self.attention_reg >= 0:
            raise ConfigError(f"attention_reg must be 0 or more, got {self.attention_reg}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ShowAttendTellConfig:
        d = dict(d)
        d["encoder"] = EncoderSpec(**d.get("encoder", {}))
        return cls(**d)


@dataclass
class LSTMState:
    """One row per hypothesis (R = B·K under beam search)."""

    memory: Tensor  # (B, N, De): one row per image, shared by its beams
    keys: Tensor  # (B, N, A) the image tokens' key projection, made once per caption
    keep: Tensor | None  # (B, N) True at real image tokens
    h: Tensor  # (R, Hd)
    c: Tensor  # (R, Hd)
    tokens: Tensor  # (R, t) fed so far; the last one is read by the next step


class ShowAttendTell(nn.Module):
    kind = "lstm"

    def __init__(self, config: ShowAttendTellConfig):
        super().__init__()
        self.config = config
        e = config.encoder
        self.encoder = build_encoder(e.preset, e.overrides, e.pretrained)
        self.num_prefix_tokens = memory_prefix_tokens(self.encoder, config.memory)
        self.memory_pos = MemoryPositions(self.encoder, self.num_prefix_tokens) if config.memory_pos else None
        d, hd, emb = self.encoder.config.embed_dim, config.hidden_dim, config.embed_dim
        self.embed = nn.Embedding(config.vocab_size, emb)
        self.init_h = nn.Linear(d, hd)
        self.init_c = nn.Linear(d, hd)
        self.attention = AdditiveAttention(hd, d, config.attn_dim)
        self.gate = nn.Linear(hd, d)
        self.lstm = nn.LSTMCell(emb + d, hd)
        self.out_h = nn.Linear(hd, emb)
        self.out_z = nn.Linear(d, emb)
        self.head = nn.Linear(emb, config.vocab_size)
        self.drop = nn.Dropout(config.drop)
        self.max_len = config.max_len
        self.grid = self.encoder.patch_embed.grid_size

    def no_weight_decay(self) -> set[str]:
        return {f"encoder.{n}" for n in self.encoder.no_weight_decay()} | {"embed.weight", "memory_pos.table"}

    def param_groups(self, weight_decay: float) -> list[dict]:
        return param_groups(self, weight_decay)

    def encode(self, images: Tensor) -> Tensor:
        memory = encode_memory(self.encoder, images, self.config.memory)  # (B, N, De)
        return memory if self.memory_pos is None else self.memory_pos(memory)

    def _initial(self, memory: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        if keep is None:
            mean = memory.mean(1)  # (R, De)
        else:
            w = keep.to(memory.dtype)[..., None]  # (R, N, 1)
            mean = (memory * w).sum(1) / w.sum(1).clamp_min(1)
        return self.init_h(mean), self.init_c(mean)

    def _attend(self, h: Tensor, memory: Tensor, keys: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """`self.attention(h, memory, mask=keep)` with the keys' projection `keys` (B, N, A) made once per
        caption instead of at every word (it was a third of a training step): context (R, De), alpha (R, N).

        h has R = B·G rows, G per image (an image's beams under beam search): the G queries of an image
        read its one memory row by broadcasting."""
        queries = rearrange(h, "(b g) d -> b g d", b=memory.shape[0])  # (B, G, Dh): an image's G queries
        context, alpha = self.attention(queries, memory, mask=keep, projected_keys=keys)  # (B, G, De), (B, G, N)
        return context.flatten(0, 1), alpha.flatten(0, 1)  # (R, De), (R, N)

    def _step(self, word: Tensor, h: Tensor, c: Tensor, memory: Tensor, keys: Tensor, keep: Tensor | None):
        """word (R,) -> logits (R, V), alpha (R, N), h, c."""
        e = self.embed(word)  # (R, E)
        z, alpha = self._attend(h, memory, keys, keep)  # (R, De), (R, N)
        z = torch.sigmoid(self.gate(h)) * z  # the gate: how much the image matters for this word
        h, c = self.lstm(torch.cat([e, z], -1), (h, c))
        logits = self.head(self.drop(e + self.out_h(h) + self.out_z(z)))
        return logits, alpha, h, c

    # -- training --------------------------------------------------------------------------------------
    def forward(self, images: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None):
        """Teacher forcing: tokens (B, T) -> logits (B, T-1, V), alphas (B, T-1, N)."""
        return self.teacher_forced(self.encode(images), tokens, memory_padding=memory_padding)

    def teacher_forced(self, memory: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None):
        """`forward` from an encoded memory (B, N, De)."""
        keep = None if memory_padding is None else ~memory_padding
        h, c = self._initial(memory, keep)
        keys = self.attention.key_proj(memory)  # (B, N, A)
        logits, alphas = [], []
        for t in range(tokens.shape[1] - 1):
            out, alpha, h, c = self._step(tokens[:, t], h, c, memory, keys, keep)
            logits.append(out)
            alphas.append(alpha)
        return torch.stack(logits, 1), torch.stack(alphas, 1)

    def packed(self, memory: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None):
        """`teacher_forced` that stops each caption at its last real target: the rows are sorted by
        length, and step t runs only the rows whose caption is still going (the batch shrinks as captions
        end), so no step is spent on pads. Logits and alphas are zeros at pad targets (B, T-1, V),
        (B, T-1, N); at real ones they equal `teacher_forced`'s, and so do the loss and its gradients."""
        keep = None if memory_padding is None else ~memory_padding
        b, n = memory.shape[:2]
        steps = (tokens[:, 1:] != PAD).sum(1)  # (B,) real targets per row: captions are padded on the right
        order = steps.argsort(descending=True, stable=True)
        memory, tokens, steps = memory[order], tokens[order], steps[order]
        keep = None if keep is None else keep[order]
        running = (steps[None] > torch.arange(tokens.shape[1] - 1, device=steps.device)[:, None]).sum(1).tolist()
        h, c = self._initial(memory, keep)
        keys = self.attention.key_proj(memory)  # (B, N, A)
        logits, alphas = [], []
        for t, r in enumerate(running):  # rows [0, r) still have a real target at step t
            if r == 0:
                break
            out, alpha, h, c = self._step(tokens[:r, t], h[:r], c[:r], memory[:r], keys[:r],
                                          None if keep is None else keep[:r])
            logits.append(F.pad(out, (0, 0, 0, b - r)))  # (B, V)
            alphas.append(F.pad(alpha, (0, 0, 0, b - r)))  # (B, N)
        if not logits:  # no real target at all
            logits, alphas = [memory.new_zeros(b, self.head.out_features)], [memory.new_zeros(b, n)]
        while len(logits) < tokens.shape[1] - 1:  # columns that are pads in every row
            logits.append(torch.zeros_like(logits[-1]))
            alphas.append(torch.zeros_like(alphas[-1]))
        inverse = order.argsort()
        return torch.stack(logits, 1)[inverse], torch.stack(alphas, 1)[inverse]

    def losses(self, images: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None) -> dict[str, Tensor]:
        """{'loss': xent + reg, 'xent', 'attention_reg', 'correct', 'targets'}: see `memory_losses`."""
        return self.memory_losses(self.encode(images), tokens, memory_padding=memory_padding)

    def memory_losses(self, memory: Tensor, tokens: Tensor, *,
                      memory_padding: Tensor | None = None) -> dict[str, Tensor]:
        """The training loss from an encoded memory (B, N, De) and captions (B, T).

        The paper's objective is a sum over the caption, -sum_t log p(y_t) + lambda * sum_i (1 - sum_t
        alpha_ti)^2 per image; here both terms are divided by the batch's real targets, so 'xent' is the
        mean cross-entropy per word and lambda keeps the paper's weight against it. (Summing the
        regulariser per image against a per-word mean weighs it about as many times more as a caption has
        words, and it then rewards spreading every word's attention over the whole image.)
        'correct' and 'targets': the real targets the argmax gets right, and the real targets."""
        logits, alphas = self.packed(memory, tokens, memory_padding=memory_padding)
        targets = tokens[:, 1:]
        xent = masked_xent(logits, tokens, label_smoothing=self.config.label_smoothing)
        words = (targets != PAD).sum().clamp_min(1)
        coverage = alphas.float().sum(1)  # (B, N): sum_t alpha_ti over the real steps (zeros at pads)
        gap = (1 - coverage) ** 2
        if memory_padding is not None:
            gap = gap.masked_fill(memory_padding, 0.0)
        reg = self.config.attention_reg * gap.sum() / words
        return {"loss": xent + reg, "xent": xent, "attention_reg": reg, **token_counts(logits, tokens)}

    def loss(self, images: Tensor, tokens: Tensor, *, memory_padding: Tensor | None = None) -> Tensor:
        return self.losses(images, tokens, memory_padding=memory_padding)["loss"]

    # -- the step interface (vitscope.sequence.decoding) -------------------------------------------------
    def start(self, memory: Tensor, memory_padding: Tensor | None = None, *, use_cache: bool = True,
              bos: int = 1, beams: int = 1) -> LSTMState:
        """`beams` hypotheses per image, one row each (R = B·beams), sharing the image's memory and keys.
        `use_cache` is accepted for a common interface: an LSTM's state is its cache."""
        keep = None if memory_padding is None else ~memory_padding
        h, c = self._initial(memory, keep)
        h, c = h.repeat_interleave(beams, 0), c.repeat_interleave(beams, 0)  # (R, Hd), once per caption
        tokens = torch.full((h.shape[0], 1), bos, dtype=torch.long, device=memory.device)
        return LSTMState(memory, self.attention.key_proj(memory), keep, h, c, tokens)

    def step(self, state: LSTMState) -> tuple[Tensor, Tensor, LSTMState]:
        """Logits for the token after state.tokens (R, V) and the alignment that chose it (R, N)."""
        logits, alpha, h, c = self._step(state.tokens[:, -1], state.h, state.c, state.memory, state.keys,
                                         state.keep)
        return logits, alpha, LSTMState(state.memory, state.keys, state.keep, h, c, state.tokens)

    def extend(self, state: LSTMState, token: Tensor) -> LSTMState:
        state.tokens = torch.cat([state.tokens, token[:, None]], 1)
        return state

    def reorder(self, state: LSTMState, index: Tensor) -> LSTMState:
        """Rows `index` (R,) of the hypotheses, each within its image's beams: only the recurrent state and
        the tokens follow them; the memory, keys and mask stay one row per image."""
        return LSTMState(state.memory, state.keys, state.keep, state.h.index_select(0, index),
                         state.c.index_select(0, index), state.tokens.index_select(0, index))

"""The RNN translators: a bidirectional GRU encoder, and a GRU decoder that attends to its states with additive
(Bahdanau) attention at every output word, or, without attention, reads one context vector for the whole
sentence (the bottleneck of Cho et al. 2014 that attention removed).

    h_1..h_N = BiGRU(E_src x_1..x_N)                                 (B, N, 2H)  the memory
    c        = [forward h_N ; backward h_1]                          (B, 2H)     the whole sentence in one vector
    s_0      = tanh(W_init c)
    s_t      = GRU([E y_{t-1} ; c_{t-1}], s_{t-1})                   the previous word and context ("input feeding")
    alpha_t  = softmax_i( v^T tanh(W_s s_t + W_h h_i) )              (R, N)      AdditiveAttention, pads masked
    c_t      = sum_i alpha_ti h_i                                    without attention: c_t = c at every word
    p(y_t)   = softmax( W_o dropout(tanh(W_out [s_t ; c_t ; E y_{t-1}])) )

The attention's query is the state after reading the previous word (Luong et al.'s order; Bahdanau's queries
with s_{t-1}): the word just written is then part of the question "which source word is next?". Training and
decoding run the same `_step`, so teacher-forced logits equal the step-by-step ones. The step interface is
vitscope.sequence.decoding's: `start(memory, padding)`, `step`, `reorder`, `extend`, so greedy and beam search
are the ones captioning uses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from vitscope.attention import AdditiveAttention
from vitscope.fields import check_decoder_sizes, check_types
from vitscope.param_groups import param_groups
from vitscope.sequence.loss import sequence_losses
from vitscope.sequence.vocab import BOS, PAD


@dataclass
class RNNTranslatorConfig:
    src_vocab_size: int
    tgt_vocab_size: int
    embed_dim: int = 128
    hidden_dim: int = 128  # each direction of the encoder, and the decoder's state
    attn_dim: int = 128
    attention: bool = True  # False: one context vector for the whole sentence (the bottleneck)
    drop: float = 0.1
    max_len: int = 42  # the longest target decoded, <bos> included
    max_src_len: int = 20  # the longest source sentence (the transformer's positions; kept alike here)
    label_smoothing: float = 0.0

    def __post_init__(self):
        check_types(self)
        check_decoder_sizes(self, ("src_vocab_size", "tgt_vocab_size", "embed_dim", "hidden_dim", "attn_dim",
                                   "max_src_len"))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RNNTranslatorConfig:
        return cls(**d)


@dataclass
class RNNState:
    """One row per hypothesis (R = B·K under beam search); the memory and its keys one row per sentence."""

    memory: Tensor  # (B, N, 2H)
    keys: Tensor | None  # (B, N, A) the memory's key projection, made once per sentence
    keep: Tensor  # (B, N) True at real source words
    summary: Tensor  # (R, 2H) the one context vector
    s: Tensor  # (R, H)
    context: Tensor  # (R, 2H) the last step's context
    tokens: Tensor  # (R, t) fed so far


def sentence_summary(memory: Tensor, keep: Tensor) -> Tensor:
    """[forward state at the last real word ; backward state at the first]: (B, 2H) from memory (B, N, 2H)."""
    h = memory.shape[-1] // 2
    last = keep.sum(1).clamp_min(1) - 1  # (B,)
    forward = memory[torch.arange(memory.shape[0], device=memory.device), last, :h]  # (B, H)
    return torch.cat([forward, memory[:, 0, h:]], -1)


class RNNTranslator(nn.Module):
    kind = "rnn"

    def __init__(self, config: RNNTranslatorConfig):
        super().__init__()
        self.config = config
        e, h = config.embed_dim, config.hidden_dim
        self.src_embed = nn.Embedding(config.src_vocab_size, e, padding_idx=PAD)
        self.encoder = nn.GRU(e, h, batch_first=True, bidirectional=True)
        self.tgt_embed = nn.Embedding(config.tgt_vocab_size, e, padding_idx=PAD)
        self.init_state = nn.Linear(2 * h, h)
        self.attention = AdditiveAttention(h, 2 * h, config.attn_dim) if config.attention else None
        self.gru = nn.GRUCell(e + 2 * h, h)
        self.out = nn.Linear(h + 2 * h + e, e)
        self.head = nn.Linear(e, config.tgt_vocab_size)
        self.drop = nn.Dropout(config.drop)
        self.max_len = config.max_len

    @property
    def has_attention(self) -> bool:
        return self.attention is not None

    def no_weight_decay(self) -> set[str]:
        return {"src_embed.weight", "tgt_embed.weight"}

    def param_groups(self, weight_decay: float) -> list[dict]:
        return param_groups(self, weight_decay)

    def encode(self, src: Tensor) -> Tensor:
        """src (B, N) word ids, `<pad>` on the right -> memory (B, N, 2H), zeros at pads."""
        lengths = (src != PAD).sum(1).clamp_min(1)
        packed = pack_padded_sequence(self.drop(self.src_embed(src)), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        out, _ = self.encoder(packed)
        memory, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        return memory  # (B, N, 2H)

    def _context(self, s: Tensor, state: RNNState) -> tuple[Tensor, Tensor]:
        """The context (R, 2H) and alignment (R, N) for the decoder states s (R, H); the R = B·G rows of a
        sentence (its beams) read its one memory row by broadcasting."""
        b, n = state.memory.shape[:2]
        if self.attention is None:
            return state.summary, s.new_zeros(s.shape[0], n)
        queries = rearrange(s, "(b g) d -> b g d", b=b)  # (B, G, H)
        context, alpha = self.attention(queries, state.memory, mask=state.keep, projected_keys=state.keys)
        return context.flatten(0, 1), alpha.flatten(0, 1)  # (R, 2H), (R, N)

    def _step(self, state: RNNState) -> tuple[Tensor, Tensor, RNNState]:
        e = self.tgt_embed(state.tokens[:, -1])  # (R, E)
        s = self.gru(torch.cat([e, state.context], -1), state.s)  # (R, H)
        context, alpha = self._context(s, state)
        logits = self.head(self.drop(torch.tanh(self.out(torch.cat([s, context, e], -1)))))  # (R, V)
        return logits, alpha, RNNState(state.memory, state.keys, state.keep, state.summary, s, context, state.tokens)

    # -- the step interface (vitscope.sequence.decoding) ----------------------------------------------------
    def start(self, memory: Tensor, memory_padding: Tensor | None = None, *, use_cache: bool = True,
              bos: int = BOS, beams: int = 1) -> RNNState:
        """`beams` rows per sentence (R = B·beams) sharing its memory; `use_cache` is accepted for a common
        interface (an RNN's state is its cache)."""
        keep = (torch.ones(memory.shape[:2], dtype=torch.bool, device=memory.device) if memory_padding is None
                else ~memory_padding)
        summary = sentence_summary(memory, keep)  # (B, 2H)
        s = torch.tanh(self.init_state(summary)).repeat_interleave(beams, 0)  # (R, H)
        summary = summary.repeat_interleave(beams, 0)
        context = summary if self.attention is None else torch.zeros_like(summary)
        keys = None if self.attention is None else self.attention.key_proj(memory)
        tokens = torch.full((s.shape[0], 1), bos, dtype=torch.long, device=memory.device)
        return RNNState(memory, keys, keep, summary, s, context, tokens)

    def step(self, state: RNNState) -> tuple[Tensor, Tensor, RNNState]:
        """Logits for the word after state.tokens (R, V) and the alignment that chose it (R, N)."""
        return self._step(state)

    def extend(self, state: RNNState, token: Tensor) -> RNNState:
        state.tokens = torch.cat([state.tokens, token[:, None]], 1)
        return state

    def reorder(self, state: RNNState, index: Tensor) -> RNNState:
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        return RNNState(state.memory, state.keys, state.keep, pick(state.summary), pick(state.s),
                        pick(state.context), pick(state.tokens))

    # -- training ----------------------------------------------------------------------------------------------
    def forward(self, src: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing: src (B, N), tgt (B, T) `<bos>` ... `<eos>` `<pad>` -> logits (B, T-1, V) and the
        alignments (B, T-1, N), row t for the step that predicts tgt[:, t+1]."""
        memory = self.encode(src)
        state = self.start(memory, src == PAD)
        logits, alphas = [], []
        for t in range(tgt.shape[1] - 1):
            state.tokens = tgt[:, t : t + 1]
            out, alpha, state = self._step(state)
            logits.append(out)
            alphas.append(alpha)
        return torch.stack(logits, 1), torch.stack(alphas, 1)

    def losses(self, src: Tensor, tgt: Tensor) -> dict[str, Tensor]:
        """{'loss', 'xent', 'correct', 'targets'}: the mean cross-entropy over real target words."""
        logits, _ = self(src, tgt)
        return sequence_losses(logits, tgt, label_smoothing=self.config.label_smoothing)

"""Greedy decoding and batched beam search, for both captioners through one small step interface.

A captioner decodes as a `StepModel`:

    memory = model.encode(images)                        (B, N, De)
    state  = model.start(memory, padding, use_cache=...)  one row per hypothesis, <bos> fed
    logits, attention, state = model.step(state)         (R, V), (R, *A): scores for the next token
    state  = model.reorder(state, rows)                  keep rows (R',): beams reselected
    state  = model.extend(state, tokens)                 append the chosen token (R,) to each row

The transformer's attention per step is its cross-attention (L, H, N); the LSTM's its alignment (N).

Scores are sums of log-probabilities (log_softmax in float32), never raw logits. <pad> and <bos> are
never generated. After <eos> a hypothesis only emits <pad> at no cost, so it keeps its score and
length. The length penalty ranks by log_prob / length ** length_penalty, with length the real
tokens after <bos> (the words and the <eos>, if any; never pads); 0 ranks by the summed
log-probability. A hypothesis that never emits <eos> ends at `max_len` tokens (<bos> included).

Beam search runs all images at once: B images x K beams are B·K rows of one batch, and each step
picks each image's K best continuations with one `topk` over its K·V candidates. Reselecting beams
reorders the model's state (the transformer's KV caches: index_select on the row dim). The first
step starts from one live beam per image (the others at -inf), so no continuation is counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from vitscope.caption.vocab import BOS, EOS, PAD, Vocabulary
from vitscope.errors import ConfigError


class StepModel(Protocol):
    """A captioner as decoding sees it. Its state has `tokens` (R, t), the tokens fed so far;
    `num_prefix_tokens` and `grid` say how the memory's tokens lie on the image."""

    max_len: int

    def encode(self, images: Tensor) -> Tensor: ...
    def start(self, memory: Tensor, memory_padding: Tensor | None = None, *, use_cache: bool = True,
              bos: int = BOS) -> Any: ...
    def step(self, state: Any) -> tuple[Tensor, Tensor, Any]: ...
    def reorder(self, state: Any, index: Tensor) -> Any: ...
    def extend(self, state: Any, token: Tensor) -> Any: ...


@dataclass
class Decoded:
    """Decoding's result, one caption per image.

    tokens (B, L): <bos> w1 ... <eos> then <pad>. attention (B, L-1, *A): row t is the attention of
    the step that chose tokens[:, t+1] (zeros after the caption ends). log_prob (B,) the summed
    log-probabilities of the chosen tokens, score (B,) log_prob / length ** length_penalty, lengths
    (B,) the real tokens after <bos>. Beam search also gives every final beam, best first:
    beam_tokens (B, K, L) and beam_scores (B, K).
    """

    tokens: Tensor
    attention: Tensor
    log_prob: Tensor
    score: Tensor
    lengths: Tensor
    beam_tokens: Tensor | None = None
    beam_scores: Tensor | None = None

    def words(self, vocab: Vocabulary) -> list[list[str]]:
        return [vocab.decode_words(t) for t in self.tokens]

    def captions(self, vocab: Vocabulary) -> list[str]:
        return [vocab.decode(t) for t in self.tokens]


def _check(model: StepModel, max_len: int, beam: int = 1) -> None:
    if beam < 1:
        raise ConfigError(f"beam size must be at least 1, got {beam}")
    if max_len < 2:
        raise ConfigError(f"max_len must leave room for <bos> and one token, got {max_len}")
    if max_len > model.max_len:
        raise ConfigError(f"max_len={max_len} exceeds the decoder's {model.max_len} positions; "
                         f"decode with max_len <= {model.max_len} or train a decoder with more")


def _banned_ngrams(tokens: Tensor, n: int, vocab_size: int) -> Tensor | None:
    """(R, V) bool: tokens that would repeat an n-gram already in each row of tokens (R, t)."""
    t = tokens.shape[1]
    if n <= 0 or t < n:
        return None
    windows = tokens.unfold(1, n, 1)  # (R, W, n): every n-gram so far
    prefix = tokens[:, t - n + 1:]  # (R, n-1): what the next token would complete
    match = (windows[..., :-1] == prefix[:, None]).all(-1)  # (R, W)
    # scatter_add (not scatter): one token may be banned by one window and not another
    hits = torch.zeros(tokens.shape[0], vocab_size, device=tokens.device)
    return hits.scatter_add_(1, windows[..., -1], match.float()) > 0


def _next_log_probs(logits: Tensor, tokens: Tensor, done: Tensor, no_repeat_ngram_size: int) -> Tensor:
    """log_softmax of the logits (R, V), with <pad>/<bos> and repeated n-grams at -inf; a finished
    row may only emit <pad>, at log-probability 0."""
    logp = F.log_softmax(logits.float(), dim=-1)
    logp[:, PAD] = float("-inf")
    logp[:, BOS] = float("-inf")
    banned = _banned_ngrams(tokens, no_repeat_ngram_size, logp.shape[1])
    if banned is not None:
        logp = logp.masked_fill(banned, float("-inf"))
    finished = torch.full_like(logp, float("-inf"))
    finished[:, PAD] = 0.0
    return torch.where(done[:, None], finished, logp)


def _penalised(log_prob: Tensor, lengths: Tensor, length_penalty: float) -> Tensor:
    return log_prob / lengths.clamp_min(1).to(log_prob.dtype) ** length_penalty


def _memory(model: StepModel, images: Tensor | None, memory: Tensor | None) -> Tensor:
    if (images is None) == (memory is None):
        raise ValueError("give images (B, C, H, W) or an encoded memory (B, N, D), one of them")
    return model.encode(images) if memory is None else memory


@torch.no_grad()
def greedy(model: StepModel, images: Tensor | None = None, *, memory: Tensor | None = None,
           memory_padding: Tensor | None = None, max_len: int | None = None, use_cache: bool = True,
           no_repeat_ngram_size: int = 0, length_penalty: float = 0.0) -> Decoded:
    """The most likely token at every step. Call model.eval() first for deterministic output."""
    max_len = model.max_len if max_len is None else max_len
    _check(model, max_len)
    memory = _memory(model, images, memory)
    b = memory.shape[0]
    state = model.start(memory, memory_padding, use_cache=use_cache)
    done = torch.zeros(b, dtype=torch.bool, device=memory.device)
    log_prob = torch.zeros(b, device=memory.device)
    lengths = torch.zeros(b, dtype=torch.long, device=memory.device)
    attention = []
    for _ in range(max_len - 1):
        logits, att, state = model.step(state)
        logp = _next_log_probs(logits, state.tokens, done, no_repeat_ngram_size)
        token = logp.argmax(-1)  # (B,)
        log_prob += logp.gather(1, token[:, None])[:, 0]
        lengths += ~done
        attention.append(att.float() * (~done).view(-1, *[1] * (att.ndim - 1)))
        state = model.extend(state, token)
        done = done | (token == EOS)
        if done.all():
            break
    return Decoded(state.tokens, torch.stack(attention, 1), log_prob, _penalised(log_prob, lengths, length_penalty),
                   lengths)


@torch.no_grad()
def beam_search(model: StepModel, images: Tensor | None = None, *, beam: int = 5, memory: Tensor | None = None,
                memory_padding: Tensor | None = None, max_len: int | None = None, use_cache: bool = True,
                length_penalty: float = 0.0, no_repeat_ngram_size: int = 0) -> Decoded:
    """Batched beam search: every image's K beams are rows of one batch (B·K rows)."""
    max_len = model.max_len if max_len is None else max_len
    _check(model, max_len, beam)
    memory = _memory(model, images, memory)
    b, k, dev = memory.shape[0], beam, memory.device
    rows = torch.arange(b, device=dev).repeat_interleave(k)  # (B·K,): each image K times
    pad = memory_padding.index_select(0, rows) if memory_padding is not None else None
    state = model.start(memory.index_select(0, rows), pad, use_cache=use_cache)
    log_prob = torch.full((b, k), float("-inf"), device=dev)
    log_prob[:, 0] = 0.0  # one live beam per image to start from
    done = torch.zeros(b, k, dtype=torch.bool, device=dev)
    lengths = torch.zeros(b, k, dtype=torch.long, device=dev)
    history = None  # (B·K, t, *A): the attention of each beam's chosen tokens
    base = torch.arange(b, device=dev)[:, None] * k  # (B, 1): first row of each image
    for _ in range(max_len - 1):
        logits, att, state = model.step(state)
        logp = _next_log_probs(logits, state.tokens, done.flatten(), no_repeat_ngram_size)  # (B·K, V)
        v = logp.shape[1]
        candidates = (log_prob[:, :, None] + logp.view(b, k, v)).view(b, k * v)  # (B, K·V)
        log_prob, flat = candidates.topk(k, dim=1)  # (B, K) each, best first
        src, token = flat // v, flat % v  # the beam each winner extends, and its token
        index = (base + src).flatten()  # (B·K,) rows of the state to keep
        state = model.extend(model.reorder(state, index), token.flatten())
        was_done = done.gather(1, src)
        lengths = lengths.gather(1, src) + (~was_done)
        done = was_done | (token == EOS)
        att = att.float().index_select(0, index)
        att = att * (~was_done).flatten().view(-1, *[1] * (att.ndim - 1))
        history = att[:, None] if history is None else torch.cat([history.index_select(0, index), att[:, None]], 1)
        if done.all():
            break
    scores = _penalised(log_prob, lengths, length_penalty)  # (B, K)
    order = scores.argsort(dim=1, descending=True)
    scores, log_prob, lengths = scores.gather(1, order), log_prob.gather(1, order), lengths.gather(1, order)
    pick = (base + order).flatten()
    tokens = state.tokens.index_select(0, pick).view(b, k, -1)  # (B, K, L)
    history = history.index_select(0, pick).view(b, k, *history.shape[1:])
    return Decoded(tokens[:, 0], history[:, 0], log_prob[:, 0], scores[:, 0], lengths[:, 0],
                   beam_tokens=tokens, beam_scores=scores)


def decode(model: StepModel, images: Tensor | None = None, *, beam: int = 1, **kwargs) -> Decoded:
    """Greedy for beam == 1, else beam search; keyword arguments as theirs."""
    if beam < 1:
        raise ConfigError(f"beam size must be at least 1, got {beam}")
    return greedy(model, images, **kwargs) if beam == 1 else beam_search(model, images, beam=beam, **kwargs)

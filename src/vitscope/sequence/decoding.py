"""Greedy decoding and batched beam search, for both captioners through one small step interface.

A captioner decodes as a `StepModel`:

    memory = model.encode(images)                        (B, N, De)
    state  = model.start(memory, padding, use_cache=..., beams=K)  K rows per image, <bos> fed
    logits, attention, state = model.step(state)         (R, V), (R, *A): scores for the next token
    state  = model.reorder(state, rows)                  rows (R,), each within its image: beams reselected
    state  = model.extend(state, tokens)                 append the chosen token (R,) to each row

The transformer's attention per step is its cross-attention (L, H, N); the LSTM's its alignment (N).

Scores are sums of log-probabilities (log_softmax in float32), never raw logits. `<pad>` and `<bos>` are
never generated. In greedy decoding a caption that has ended only emits `<pad>` at no cost, so it keeps
its score and length; beam search moves it to its image's pool (below). The length penalty ranks by
log_prob / length ** length_penalty, with length the real tokens after `<bos>` (the words and the `<eos>`,
if any; never pads); 0 ranks by the summed log-probability. A hypothesis that never emits `<eos>` ends
at `max_len` tokens (`<bos>` included).

Beam search is the standard one (fairseq's search, transformers' BeamSearchScorer), for all images at
once: B images x K beams are B·K rows of one batch. Each step takes each image's 2K best continuations
(one `topk` over its K·V candidates). A continuation ending in `<eos>` among the K best goes to the image's
pool of finished hypotheses, scored with the length penalty as it finishes; the pool keeps its K best.
The K best that do not end stay live. An image is done when its pool holds K hypotheses and no live beam
can still beat the pool's worst: log-probabilities only fall, so a live beam's best possible score is
its log-probability now, divided by the most favourable length still open to it (the longest when
length_penalty > 0, the next one otherwise). That is transformers' `early_stopping="never"`: the
search stops only when nothing better can come. At `max_len` the live beams join the pool. The best of
the pool is the caption; every member is in `beam_tokens`/`beam_scores`/`beam_attention`.

An image's beams share its memory (and the transformer's cross-attention keys/values): one row per
image, read by broadcasting. Reselecting beams reorders only what differs between them (the
self-attention caches, the LSTM's state, the tokens). The attention of each hypothesis is traced back
through the reselections once at the end, not copied at every step. The first step starts from one
live beam per image (the others at -inf), so no continuation is counted twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from vitscope.errors import ConfigError
from vitscope.sequence.vocab import BOS, EOS, PAD, Vocabulary


class StepModel(Protocol):
    """A captioner as decoding sees it. Its state has `tokens` (R, t), the tokens fed so far;
    `num_prefix_tokens` and `grid` say how the memory's tokens lie on the image."""

    max_len: int

    def encode(self, images: Tensor) -> Tensor: ...
    def start(self, memory: Tensor, memory_padding: Tensor | None = None, *, use_cache: bool = True,
              bos: int = BOS, beams: int = 1) -> Any: ...
    def step(self, state: Any) -> tuple[Tensor, Tensor, Any]: ...
    def reorder(self, state: Any, index: Tensor) -> Any: ...
    def extend(self, state: Any, token: Tensor) -> Any: ...


@dataclass
class Decoded:
    """Decoding's result, one caption per image.

    tokens (B, L): `<bos>` w1 ... `<eos>` then `<pad>`. attention (B, L-1, *A): row t is the attention of
    the step that chose tokens[:, t+1] (zeros after the caption ends). log_prob (B,) the summed
    log-probabilities of the chosen tokens, score (B,) log_prob / length ** length_penalty, lengths
    (B,) the real tokens after `<bos>`. Beam search also gives every hypothesis of each image's pool,
    best first: beam_tokens (B, K, L'), beam_scores (B, K) (-inf where fewer than K were found) and
    beam_attention (B, K, L'-1, *A).
    """

    tokens: Tensor
    attention: Tensor
    log_prob: Tensor
    score: Tensor
    lengths: Tensor
    beam_tokens: Tensor | None = None
    beam_scores: Tensor | None = None
    beam_attention: Tensor | None = None

    def words(self, vocab: Vocabulary) -> list[list[str]]:
        return [vocab.decode_words(t) for t in self.tokens]

    def captions(self, vocab: Vocabulary) -> list[str]:
        return [vocab.decode(t) for t in self.tokens]


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode, as `vitscope caption`, `vitscope translate` and `vitscope eval` take it from their flags:
    beam size (1: greedy), the longest output in tokens with `<bos>` (None: the decoder's positions), the length
    penalty and the n-gram size never repeated (0: off). Checked when made, and against a model by `check`."""

    beam: int = 1
    max_len: int | None = None
    length_penalty: float = 0.0
    no_repeat_ngram_size: int = 0

    def __post_init__(self):
        if isinstance(self.beam, bool) or not isinstance(self.beam, int) or self.beam < 1:
            raise ConfigError(f"beam size must be at least 1 (a whole number), got {self.beam!r}")
        if self.max_len is not None and self.max_len < 2:
            raise ConfigError(f"max_len must leave room for <bos> and one token, got {self.max_len}")
        if not math.isfinite(self.length_penalty):
            raise ConfigError(f"length penalty {self.length_penalty} is not a finite number; give one such as 0 "
                              f"(rank by summed log-probability) or 1 (by log-probability per token)")
        if self.no_repeat_ngram_size < 0:
            raise ConfigError(f"no_repeat_ngram_size must be 0 (off) or more, got {self.no_repeat_ngram_size}")

    def check(self, model: StepModel) -> None:
        """Before any work: a maximum length the model's decoder positions hold."""
        if self.max_len is not None and self.max_len > model.max_len:
            raise ConfigError(f"max_len={self.max_len} exceeds the decoder's {model.max_len} positions (<bos> "
                              f"included); outputs can be 2 to {model.max_len} tokens long (--max-len): choose one "
                              f"in that range")

    def kwargs(self) -> dict:
        """The keyword arguments of `decode`."""
        return {"beam": self.beam, "max_len": self.max_len, "length_penalty": self.length_penalty,
                "no_repeat_ngram_size": self.no_repeat_ngram_size}


def _check(model: StepModel, max_len: int, beam: int = 1, length_penalty: float = 0.0) -> None:
    DecodeOptions(beam=beam, max_len=max_len, length_penalty=length_penalty).check(model)


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


def _next_log_probs(logits: Tensor, tokens: Tensor, done: Tensor | None, no_repeat_ngram_size: int) -> Tensor:
    """log_softmax of the logits (R, V), with `<pad>`/`<bos>` and repeated n-grams at -inf; a finished
    row (`done`) may only emit `<pad>`, at log-probability 0."""
    logp = F.log_softmax(logits.float(), dim=-1)
    logp[:, PAD] = float("-inf")
    logp[:, BOS] = float("-inf")
    banned = _banned_ngrams(tokens, no_repeat_ngram_size, logp.shape[1])
    if banned is not None:
        logp = logp.masked_fill(banned, float("-inf"))
    if done is None:
        return logp
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
    _check(model, max_len, 1, length_penalty)
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


class _Pool:
    """Each image's K best finished hypotheses, sorted best first: scores (B, K) (-inf while empty), their
    log-probabilities, lengths, tokens (B, K, max_len) and where each one's last token was chosen (the step,
    and the row of the batch at that step), from which its attention is traced at the end."""

    def __init__(self, b: int, k: int, max_len: int, device: torch.device):
        self.k, self.max_len = k, max_len
        self.scores = torch.full((b, k), float("-inf"), device=device)
        self.log_prob = torch.zeros(b, k, device=device)
        self.lengths = torch.zeros(b, k, dtype=torch.long, device=device)
        self.tokens = torch.full((b, k, max_len), PAD, dtype=torch.long, device=device)
        self.tokens[:, :, 0] = BOS
        self.end_step = torch.full((b, k), -1, dtype=torch.long, device=device)
        self.end_row = torch.zeros(b, k, dtype=torch.long, device=device)
        self.count = torch.zeros(b, dtype=torch.long, device=device)

    def add(self, log_prob: Tensor, length: int, length_penalty: float, tokens: Tensor, step: int, rows: Tensor,
            take: Tensor) -> None:
        """Offer C hypotheses per image, where `take` (B, C) is True: log_prob (B, C), tokens (B, C, length + 1),
        their last token chosen at `step` by batch rows `rows` (B, C). Each image keeps its K best."""
        b, c = log_prob.shape
        take = take & torch.isfinite(log_prob)
        new = _penalised(log_prob, torch.full_like(rows, length), length_penalty).masked_fill(~take, float("-inf"))
        scores, pick = torch.cat([self.scores, new], 1).topk(self.k, dim=1)  # (B, K) best first

        def merged(old: Tensor, offered: Tensor) -> Tensor:
            both = torch.cat([old, offered], 1)  # (B, K + C, ...)
            return both.gather(1, pick.view(b, self.k, *[1] * (both.ndim - 2)).expand(-1, -1, *both.shape[2:]))

        self.scores = scores
        self.log_prob = merged(self.log_prob, log_prob)
        self.lengths = merged(self.lengths, torch.full_like(rows, length))
        self.tokens = merged(self.tokens, F.pad(tokens, (0, self.max_len - tokens.shape[2]), value=PAD))
        self.end_step = merged(self.end_step, torch.full_like(rows, step))
        self.end_row = merged(self.end_row, rows)
        self.count = (self.count + take.sum(1)).clamp_max(self.k)


def _trace(attention: list[Tensor], parents: list[Tensor], end_step: Tensor, end_row: Tensor) -> Tensor:
    """The attention of each hypothesis's chosen tokens, (P, S, *A), by walking back from where its last
    token was chosen (end_step, end_row (P,)): attention[s] (R, *A) is step s's, and parents[s] (R,) the
    row at step s that each row of step s + 1 extends. Zeros after a hypothesis ends."""
    steps = len(attention)
    out = attention[0].new_zeros(end_row.shape[0], steps, *attention[0].shape[1:])
    row = end_row.clone()
    for s in range(steps - 1, -1, -1):
        on = end_step >= s  # (P,): the hypothesis had chosen a token at step s
        out[:, s] = attention[s].index_select(0, row) * on.view(-1, *[1] * (out.ndim - 2))
        if s:
            row = torch.where(on, parents[s - 1].index_select(0, row), row)
    return out


def _best_possible(log_prob: Tensor, length: int, max_len: int, length_penalty: float) -> Tensor:
    """The highest score a live beam (log_prob so far, `length` tokens after `<bos>`) can still finish with."""
    longest = max_len - 1
    return log_prob / float(longest if length_penalty > 0 else min(length + 1, longest)) ** length_penalty


@torch.no_grad()
def beam_search(model: StepModel, images: Tensor | None = None, *, beam: int = 5, memory: Tensor | None = None,
                memory_padding: Tensor | None = None, max_len: int | None = None, use_cache: bool = True,
                length_penalty: float = 0.0, no_repeat_ngram_size: int = 0) -> Decoded:
    """The standard beam search (module docstring), every image's K beams rows of one batch (B·K rows)."""
    max_len = model.max_len if max_len is None else max_len
    _check(model, max_len, beam, length_penalty)
    memory = _memory(model, images, memory)
    b, k, dev = memory.shape[0], beam, memory.device
    state = model.start(memory, memory_padding, use_cache=use_cache, beams=k)
    live = torch.full((b, k), float("-inf"), device=dev)  # summed log-probabilities of the live beams
    live[:, 0] = 0.0  # one live beam per image to start from
    pool = _Pool(b, k, max_len, dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    first_row = torch.arange(b, device=dev)[:, None] * k  # (B, 1)
    attention, parents = [], []  # per step: every row's attention (R, *A), and the rows the next step extends
    for step in range(max_len - 1):
        length = step + 1  # tokens after <bos> once this step's token is appended
        logits, att, state = model.step(state)
        attention.append(att.float())
        logp = _next_log_probs(logits, state.tokens, None, no_repeat_ngram_size)  # (B·K, V)
        v = logp.shape[1]
        candidates = (live[:, :, None] + logp.view(b, k, v)).view(b, k * v)  # (B, K·V)
        top, flat = candidates.topk(min(2 * k, k * v), dim=1)  # (B, 2K) best first
        rows, token = first_row + flat // v, flat % v  # the row each candidate extends, and its token
        ends = token == EOS
        # <eos> among the K best finishes; one ranked lower would not have been kept live either
        finish = ends[:, :k] & ~done[:, None]
        if finish.any():
            ended = torch.cat([state.tokens[rows[:, :k]], token[:, :k, None]], 2)  # (B, K, length + 1)
            pool.add(top[:, :k], length, length_penalty, ended, step, rows[:, :k], finish)
        going = ends.to(torch.int8).argsort(dim=1, stable=True)[:, :k]  # the K best not ending, in rank order
        live = top.gather(1, going)
        index = rows.gather(1, going).flatten()
        parents.append(index)
        state = model.extend(model.reorder(state, index), token.gather(1, going).flatten())
        if length == max_len - 1:  # the last position: the live beams join the pool
            pool.add(live, length, length_penalty, state.tokens.view(b, k, -1), step, index.view(b, k), ~done[:, None])
            break
        best = _best_possible(live.max(1).values, length, max_len, length_penalty)
        done |= (pool.count == k) & (pool.scores[:, -1] >= best)
        if done.all():
            break
    beam_attention = _trace(attention, parents, pool.end_step.flatten(), pool.end_row.flatten())
    width = int(pool.lengths.max()) + 1  # <bos> and the longest hypothesis
    best_width = int(pool.lengths[:, 0].max()) + 1
    tokens = pool.tokens[:, :, :width]
    beam_attention = beam_attention.view(b, k, *beam_attention.shape[1:])[:, :, :width - 1]
    return Decoded(tokens[:, 0, :best_width], beam_attention[:, 0, :best_width - 1], pool.log_prob[:, 0],
                   pool.scores[:, 0], pool.lengths[:, 0], beam_tokens=tokens, beam_scores=pool.scores,
                   beam_attention=beam_attention)


def decode(model: StepModel, images: Tensor | None = None, *, beam: int = 1, **kwargs) -> Decoded:
    """Greedy for beam == 1, else beam search; keyword arguments as theirs."""
    if beam < 1:
        raise ConfigError(f"beam size must be at least 1, got {beam}")
    return greedy(model, images, **kwargs) if beam == 1 else beam_search(model, images, beam=beam, **kwargs)

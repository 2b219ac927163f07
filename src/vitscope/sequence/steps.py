"""Decoding steps for every model whose decoder is vitscope's `TransformerDecoder`: the transformer captioner
and the transformer translator inherit them, so greedy and beam search (`vitscope.sequence.decoding`) drive
both through one implementation.

With `use_cache` each step feeds only the newest token and reuses every block's self-attention keys/values
and the memory's cross-attention keys/values; without it each step re-runs the whole prefix. Both give the
same logits. An image's (or a source sentence's) beams share its memory and cross-attention keys/values:
one row per input, read by broadcasting (see vitscope.decoder).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vitscope.attention import KVCache
from vitscope.decoder import Caches
from vitscope.sequence.vocab import BOS


@dataclass
class DecoderState:
    """What decoding carries between steps, one row per hypothesis (R = B·K under beam search)."""

    memory: Tensor  # (B, N, De): one row per input, shared by its beams
    memory_padding: Tensor | None  # (B, N) True at padded memory tokens
    caches: Caches | None  # per block (self (R, ...), cross (B, ...)) KV caches; None: re-run the prefix
    tokens: Tensor  # (R, t) every token fed so far


class DecoderSteps:
    """The step interface of `vitscope.sequence.decoding.StepModel` for a module with `self.decoder`, a
    `TransformerDecoder`. The module itself provides `encode` and `max_len`."""

    def decode_with_attention(self, tokens: Tensor, memory: Tensor, *, caches: Caches | None = None,
                              memory_padding: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The decoder with every block's cross-attention: tokens (R, T) (only the new ones with `caches`) ->
        logits (R, T, V), weights (R, T, L, H, N)."""
        return self.decoder(tokens, memory, context_padding_mask=memory_padding, caches=caches,
                            return_weights=True)

    def start(self, memory: Tensor, memory_padding: Tensor | None = None, *, use_cache: bool = True,
              bos: int = BOS, beams: int = 1) -> DecoderState:
        """`beams` hypotheses per input, one row each (R = B·beams); they all read the input's one memory row and
        its cross-attention keys/values."""
        tokens = torch.full((memory.shape[0] * beams, 1), bos, dtype=torch.long, device=memory.device)
        return DecoderState(memory, memory_padding, self.decoder.new_caches() if use_cache else None, tokens)

    def step(self, state: DecoderState) -> tuple[Tensor, Tensor, DecoderState]:
        """Logits for the token after state.tokens: (R, V), and its cross-attention (R, L, H, N)."""
        if state.caches is not None:
            new = state.tokens[:, len(state.caches[0][0]):]  # (R, 1): only what the caches lack
            logits, w = self.decode_with_attention(new, state.memory, caches=state.caches,
                                                   memory_padding=state.memory_padding)
        else:
            logits, w = self.decode_with_attention(state.tokens, state.memory, memory_padding=state.memory_padding)
        return logits[:, -1], w[:, -1], state

    def extend(self, state: DecoderState, token: Tensor) -> DecoderState:
        """Append the chosen token (R,) to every row."""
        state.tokens = torch.cat([state.tokens, token[:, None]], 1)
        return state

    def reorder(self, state: DecoderState, index: Tensor) -> DecoderState:
        """Rows `index` (R,) of the hypotheses, each index within its input's beams: beams reselected. Only what
        differs between beams follows them (the self-attention caches, the tokens); the memory and the
        cross-attention caches stay one row per input."""
        caches = None
        if state.caches is not None:
            caches = [(KVCache(s.k.index_select(0, index), s.v.index_select(0, index)) if s.k is not None
                       else KVCache(), cross) for s, cross in state.caches]
        return DecoderState(state.memory, state.memory_padding, caches, state.tokens.index_select(0, index))

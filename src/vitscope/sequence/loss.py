"""The teacher-forced loss every sequence model trains with, and the one trim of padded batches.

A batch of token rows (B, T) reads `<bos>` w1 ... `<eos>` and then `<pad>` on the right. The model reads
tokens[:, :-1] and its logits (B, T-1, V) predict tokens[:, 1:]; targets that are `<pad>` are left out of the
loss (cross-entropy's ignore_index), so a short sentence weighs as its real words, not as the batch's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vitscope.sequence.vocab import PAD


def masked_xent(logits: Tensor, tokens: Tensor, *, label_smoothing: float = 0.0, reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits (B, T-1, V) against tokens[:, 1:] (B, T), `<pad>` targets left out; in float32
    whatever the logits' dtype. reduction "mean" (per real target) or "sum"."""
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), ignore_index=PAD,
                           label_smoothing=label_smoothing, reduction=reduction)


@torch.no_grad()
def token_counts(logits: Tensor, tokens: Tensor) -> dict[str, Tensor]:
    """{'correct': the real targets the logits' argmax gets right, 'targets': the real (not `<pad>`) targets},
    as 0-d int64 tensors, for logits (B, T-1, V) against tokens (B, T)."""
    targets = tokens[:, 1:]
    real = targets != PAD
    return {"correct": ((logits.argmax(-1) == targets) & real).sum(), "targets": real.sum()}


def sequence_losses(logits: Tensor, tokens: Tensor, *, label_smoothing: float = 0.0) -> dict[str, Tensor]:
    """{'loss', 'xent', 'correct', 'targets'}: the mean cross-entropy over the real targets (the loss), and the
    counts of `token_counts`."""
    xent = masked_xent(logits, tokens, label_smoothing=label_smoothing)
    return {"loss": xent, "xent": xent, **token_counts(logits, tokens)}


def trim_padding(tokens: Tensor) -> Tensor:
    """Drop the columns that are `<pad>` in every row (B, T) -> (B, T'): a batch is as long as its longest
    sentence. A batch of nothing but pads keeps two columns."""
    real = (tokens != PAD).any(0).nonzero()
    return tokens[:, : int(real.max()) + 1] if real.numel() else tokens[:, :2]

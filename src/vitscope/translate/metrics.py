"""Translation measures: exact sentence accuracy, token accuracy, BLEU (captioning's scorer) and alignment
accuracy, the share of target words whose attention peaks on the source word they translate.

Hypotheses and references are word lists. Token accuracy compares position by position: the share of
reference words whose position in the hypothesis holds the same word (a word left out shifts the rest, and
they count as wrong, as they are). Alignment accuracy takes attention (S, T, N) or per layer and head
(S, T, L, H, N), row t for the step that wrote target word t, and the gold source position of every target
word (S, T), -1 where there is none (`<eos>`, pads); a transformer's is reported per layer and head.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from vitscope.sequence.bleu import corpus_bleu

Words = Sequence[str]


def exact_match(hypotheses: Sequence[Words], references: Sequence[Words]) -> float:
    """The share of sentences translated word for word right."""
    _check(hypotheses, references)
    return sum(list(h) == list(r) for h, r in zip(hypotheses, references)) / len(references)


def token_accuracy(hypotheses: Sequence[Words], references: Sequence[Words]) -> float:
    """The share of reference words that the hypothesis has at the same position."""
    _check(hypotheses, references)
    right = sum(sum(a == b for a, b in zip(h, r)) for h, r in zip(hypotheses, references))
    return right / max(sum(len(r) for r in references), 1)


def bleu4(hypotheses: Sequence[Words], references: Sequence[Words]) -> float:
    """Corpus BLEU-4 with one reference per sentence, as captioning scores it (pycocoevalcap's Bleu)."""
    _check(hypotheses, references)
    return corpus_bleu([list(h) for h in hypotheses], [[list(r)] for r in references])[3]


def alignment_accuracy(attention: Tensor, gold: Tensor) -> Tensor:
    """attention (S, T, [L, H,] N), gold (S, T) int with -1 where a step has no gold word -> the share of
    scored steps whose attention peaks on the gold position: a 0-d tensor, or (L, H) per layer and head."""
    if attention.shape[:2] != gold.shape:
        raise ValueError(f"attention for {tuple(attention.shape[:2])} sentences x steps, gold for "
                         f"{tuple(gold.shape)}")
    scored = gold >= 0  # (S, T)
    peak = attention.argmax(-1)  # (S, T, [L, H])
    hit = peak == gold.view(*gold.shape, *[1] * (peak.ndim - 2))
    hit = hit & scored.view(*scored.shape, *[1] * (peak.ndim - 2))
    return hit.flatten(0, 1).sum(0).double() / scored.sum().clamp_min(1)


def accuracy_by_length(hypotheses: Sequence[Words], references: Sequence[Words],
                       source_lengths: Sequence[int]) -> dict[int, tuple[float, int]]:
    """Exact sentence accuracy per source length: {length: (accuracy, sentences)}."""
    _check(hypotheses, references)
    groups: dict[int, list[bool]] = {}
    for h, r, n in zip(hypotheses, references, source_lengths):
        groups.setdefault(int(n), []).append(list(h) == list(r))
    return {n: (sum(v) / len(v), len(v)) for n, v in sorted(groups.items())}


def _check(hypotheses: Sequence[Words], references: Sequence[Words]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    if not references:
        raise ValueError("no sentences to score")


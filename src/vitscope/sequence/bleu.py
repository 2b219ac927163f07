"""BLEU (Papineni et al. 2002) over a corpus, as the COCO caption evaluation (pycocoevalcap's `Bleu(4)`)
computes it: what captioning and translation both score with.

Clipped n-gram counts and hypothesis n-gram counts are summed over all sentences before dividing; the
reference length for the brevity penalty is, per sentence, the reference length closest to the hypothesis
length (the shorter on a tie), summed over sentences; BLEU-n is the geometric mean of the precisions 1..n.
Zero counts are smoothed by 1e-15 / 1e-9 exactly as there, so a corpus with no matching 4-gram scores
BLEU-4 ~ 1e-5 ... 1e-7, not an error. Hypotheses and references are word lists.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

Words = Sequence[str]
NGram = tuple[str, ...]


def ngram_counts(words: Words, n: int = 4) -> Counter[NGram]:
    """Every k-gram for k = 1..n with its count."""
    counts: Counter[NGram] = Counter()
    for k in range(1, n + 1):
        for i in range(len(words) - k + 1):
            counts[tuple(words[i:i + k])] += 1
    return counts


def check_corpus(hypotheses: Sequence[Words], references: Sequence[Sequence[Words]]) -> None:
    """One hypothesis and at least one reference per sentence (an image's caption, a translation), as word lists."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but references for {len(references)} sentences")
    if not hypotheses:
        raise ValueError("no sentences to score")
    empty = [i for i, refs in enumerate(references) if len(refs) == 0]
    if empty:
        raise ValueError(f"sentence {empty[0]} has no reference; every scored sentence needs at least one")
    for h in (hypotheses[0], *references[0]):
        if isinstance(h, str):
            raise TypeError("sentences are word lists here, not strings: pass vocab.tokenize(text)")


# -- BLEU ------------------------------------------------------------------------------------------
_TINY, _SMALL = 1e-15, 1e-9  # the COCO code's smoothing: 0 matches -> ~0, never 0/0


def corpus_bleu(hypotheses: Sequence[Words], references: Sequence[Sequence[Words]], n: int = 4) -> list[float]:
    """[BLEU-1, ..., BLEU-n] of the corpus: one hypothesis and its references per sentence."""
    check_corpus(hypotheses, references)
    correct, guess = [0] * n, [0] * n
    hyp_len = ref_len = 0
    for hyp, refs in zip(hypotheses, references):
        max_ref: Counter[NGram] = Counter()
        for ref in refs:
            max_ref |= ngram_counts(ref, n)  # | keeps the larger count: clipping by the best reference
        for gram, count in ngram_counts(hyp, n).items():
            correct[len(gram) - 1] += min(count, max_ref[gram])
        for k in range(n):
            guess[k] += max(0, len(hyp) - k)
        hyp_len += len(hyp)
        ref_len += min((abs(len(r) - len(hyp)), len(r)) for r in refs)[1]  # closest; shorter on ties
    ratio = (hyp_len + _TINY) / (ref_len + _SMALL)
    brevity = math.exp(1 - 1 / ratio) if ratio < 1 else 1.0
    scores, product = [], 1.0
    for k in range(n):
        product *= (correct[k] + _TINY) / (guess[k] + _SMALL)
        scores.append(product ** (1 / (k + 1)) * brevity)
    return scores

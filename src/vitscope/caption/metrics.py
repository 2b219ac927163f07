"""Caption metrics: corpus BLEU-1..4 and CIDEr-D as the COCO caption evaluation computes them, and
the grounded measures that Fashion-MNIST scenes make possible.

Every metric takes, per image, one hypothesis and all of that image's references, as word lists.
`caption_words` turns token ids into such a list: cut at the first `<eos>`, `<bos>`/`<pad>` left out.
`score_captions` also drops punctuation tokens first, as the COCO evaluation's tokenizer does.

BLEU (Papineni et al. 2002) as pycocoevalcap's `Bleu(4)` scores a corpus: clipped n-gram counts
and hypothesis n-gram counts are summed over all images before dividing; the reference length for
the brevity penalty is, per image, the reference length closest to the hypothesis length (the
shorter on a tie), summed over images; BLEU-n is the geometric mean of the precisions 1..n. Zero
counts are smoothed by 1e-15 / 1e-9 exactly as there, so a corpus with no matching 4-gram scores
BLEU-4 ~ 1e-5 ... 1e-7, not an error.

CIDEr-D (Vedantam et al. 2015) as pycocoevalcap's `Cider` scores it (that class is CIDEr-D: clipped
tf-idf and a Gaussian length penalty): n-gram document frequencies are counted over the references
of the corpus being scored (an n-gram counts once per image), idf = log(#images) - log(max(1, df));
each n-gram vector is raw count x idf; per image, the cosine of the clipped hypothesis vector with
each reference vector, times exp(-delta^2 / (2 sigma^2)), averaged over references and n = 1..4,
times 10; the corpus score is the mean over images. One quirk is kept on purpose so the figures are
the same: the "length" in delta counts a sentence's bigrams (its words minus one), not its words.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vitscope.caption.vocab import Vocabulary, is_punctuation

Words = Sequence[str]
NGram = tuple[str, ...]


def caption_words(ids: Sequence[int] | Tensor, vocab: Vocabulary) -> list[str]:
    """Token ids -> words: cut at the first `<eos>`; `<bos>` and `<pad>` left out."""
    return vocab.decode_words(ids)


def ngram_counts(words: Words, n: int = 4) -> Counter[NGram]:
    """Every k-gram for k = 1..n with its count."""
    counts: Counter[NGram] = Counter()
    for k in range(1, n + 1):
        for i in range(len(words) - k + 1):
            counts[tuple(words[i:i + k])] += 1
    return counts


def _check(hypotheses: Sequence[Words], references: Sequence[Sequence[Words]]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but references for {len(references)} images")
    if not hypotheses:
        raise ValueError("no captions to score")
    empty = [i for i, refs in enumerate(references) if len(refs) == 0]
    if empty:
        raise ValueError(f"image {empty[0]} has no reference caption; every scored image needs at least one")
    for h in (hypotheses[0], *references[0]):
        if isinstance(h, str):
            raise TypeError("captions are word lists here, not strings: pass vocab.tokenize(text)")


# -- BLEU ------------------------------------------------------------------------------------------
_TINY, _SMALL = 1e-15, 1e-9  # the COCO code's smoothing: 0 matches -> ~0, never 0/0


def corpus_bleu(hypotheses: Sequence[Words], references: Sequence[Sequence[Words]], n: int = 4) -> list[float]:
    """[BLEU-1, ..., BLEU-n] of the corpus: one hypothesis and its references per image."""
    _check(hypotheses, references)
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


# -- CIDEr-D ---------------------------------------------------------------------------------------
def _tfidf(counts: Counter[NGram], df: Mapping[NGram, float], log_images: float, n: int):
    """Per n: {n-gram: count x idf} and its L2 norm; and the sentence's bigram count (see the docstring)."""
    vecs: list[dict[NGram, float]] = [{} for _ in range(n)]
    norms = [0.0] * n
    for gram, tf in counts.items():
        w = tf * (log_images - math.log(max(1.0, df.get(gram, 0.0))))
        vecs[len(gram) - 1][gram] = w
        norms[len(gram) - 1] += w * w
    bigrams = sum(tf for gram, tf in counts.items() if len(gram) == 2)
    return vecs, [math.sqrt(x) for x in norms], bigrams


def cider_d(hypotheses: Sequence[Words], references: Sequence[Sequence[Words]], *, n: int = 4,
            sigma: float = 6.0) -> tuple[float, list[float]]:
    """(corpus CIDEr-D, per-image scores). Document frequencies come from these references."""
    _check(hypotheses, references)
    ref_counts = [[ngram_counts(r, n) for r in refs] for refs in references]
    df: Counter[NGram] = Counter()
    for refs in ref_counts:
        df.update(set().union(*refs))  # once per image, however many of its references hold it
    log_images = math.log(float(len(references)))
    per_image = []
    for hyp, refs in zip(hypotheses, ref_counts):
        vh, nh, lh = _tfidf(ngram_counts(hyp, n), df, log_images, n)
        total = [0.0] * n
        for ref in refs:
            vr, nr, lr = _tfidf(ref, df, log_images, n)
            penalty = math.exp(-((lh - lr) ** 2) / (2 * sigma**2))
            for k in range(n):
                # clipped: a hypothesis n-gram is credited at most the reference's weight
                dot = sum(min(w, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, w in vh[k].items())
                if nh[k] != 0 and nr[k] != 0:
                    dot /= nh[k] * nr[k]
                total[k] += dot * penalty
        per_image.append(sum(total) / n / len(refs) * 10.0)
    return sum(per_image) / len(per_image), per_image


# -- both, from words or ids -----------------------------------------------------------------------
def metric_words(words: Words) -> list[str]:
    """Words as the COCO evaluation scores them: punctuation tokens removed."""
    return [w for w in words if not is_punctuation(w)]


def score_captions(hypotheses: Sequence[Words], references: Sequence[Sequence[Words]]) -> dict[str, float]:
    """{'bleu1'..'bleu4', 'cider'} for word lists, punctuation dropped first."""
    hyps = [metric_words(h) for h in hypotheses]
    refs = [[metric_words(r) for r in rs] for rs in references]
    bleu = corpus_bleu(hyps, refs, 4)
    cider, _ = cider_d(hyps, refs)
    return {**{f"bleu{k + 1}": b for k, b in enumerate(bleu)}, "cider": cider}


# -- grounded measures (Fashion-MNIST scenes) ------------------------------------------------------
@dataclass(frozen=True)
class GroundingResult:
    """Share of item words whose attention peaks in their item's cell.

    `per_head` (L, H); `per_layer` (L,) the head-mean map's share per layer; `mean` the map averaged
    over layers and heads; `count` how many item words were judged. For the LSTM, L = H = 1.
    """

    per_head: Tensor
    per_layer: Tensor
    mean: float
    count: int

    def to_dict(self) -> dict:
        return {"grounding": self.mean, "grounding_per_layer": self.per_layer.tolist(),
                "grounding_per_head": self.per_head.tolist(), "grounding_words": self.count}


def peak_cells(attention: Tensor, grid: tuple[int, int], image_size: tuple[int, int], cells: int) -> Tensor:
    """Cell index (row * cells + col) where each attention map peaks.

    attention (..., gh·gw) over the patch tokens (prefix tokens already removed); each patch counts
    for the cell holding its centre, so a patch grid need not divide the cell grid.
    """
    gh, gw = grid
    flat = attention.argmax(-1)  # (...)
    r, c = flat // gw, flat % gw
    y = (r.double() + 0.5) * image_size[0] / gh
    x = (c.double() + 0.5) * image_size[1] / gw
    row = (y * cells / image_size[0]).floor().long().clamp_(0, cells - 1)
    col = (x * cells / image_size[1]).floor().long().clamp_(0, cells - 1)
    return row * cells + col


def attention_grounding(words: Sequence[Words], attentions: Sequence[Tensor], scenes: Sequence,
                        *, grid: tuple[int, int], image_size: tuple[int, int],
                        num_prefix_tokens: int = 0) -> GroundingResult:
    """Grounding over a set of captions of scenes.

    words[i]: caption i as words; attentions[i]: that caption's per-word attention, (T, L, H, N)
    for the transformer's cross-attention or (T, N) for the LSTM's alignment, row t the attention
    of the step that produced word t; scenes[i]: its `Scene`. An item word is each word of a class
    name whose item the caption names (see `scenes.item_word_targets`).
    """
    from vitscope.caption.scenes import item_word_targets

    hits_head, hits_mean, total, count = None, None, 0, 0
    for ws, att, scene in zip(words, attentions, scenes):
        att = att[:, None, None] if att.ndim == 2 else att  # (T, L, H, N)
        att = att[..., num_prefix_tokens:].float()
        targets = item_word_targets(ws, scene)
        if not targets:
            continue
        if hits_head is None:
            hits_head = torch.zeros(att.shape[1], att.shape[2])
            hits_mean = torch.zeros(att.shape[1])
        for t, cell in targets:
            if t >= att.shape[0]:
                continue
            per_head = peak_cells(att[t], grid, image_size, scene.cells)  # (L, H)
            per_layer = peak_cells(att[t].mean(1), grid, image_size, scene.cells)  # (L,)
            overall = peak_cells(att[t].mean((0, 1)), grid, image_size, scene.cells)
            hits_head += (per_head == cell).float()
            hits_mean += (per_layer == cell).float()
            total += int(overall == cell)
            count += 1
    if count == 0:
        return GroundingResult(torch.zeros(0, 0), torch.zeros(0), float("nan"), 0)
    return GroundingResult(hits_head / count, hits_mean / count, total / count, count)

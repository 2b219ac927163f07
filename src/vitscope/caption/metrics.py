"""Caption metrics: corpus BLEU-1..4 and CIDEr-D as the COCO caption evaluation computes them, and
the grounded measures that Fashion-MNIST scenes make possible.

Every metric takes, per image, one hypothesis and all of that image's references, as word lists.
`caption_words` turns token ids into such a list: cut at the first `<eos>`, `<bos>`/`<pad>` left out.
`score_captions` also drops punctuation tokens first, as the COCO evaluation's tokenizer does.

BLEU is `vitscope.sequence.bleu`'s (translation scores with it too), computed as pycocoevalcap's `Bleu(4)`.

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

from vitscope.caption.scenes import item_word_targets
from vitscope.sequence.bleu import NGram, Words, check_corpus, corpus_bleu, ngram_counts
from vitscope.sequence.vocab import Vocabulary, is_punctuation


def caption_words(ids: Sequence[int] | Tensor, vocab: Vocabulary) -> list[str]:
    """Token ids -> words: cut at the first `<eos>`; `<bos>` and `<pad>` left out."""
    return vocab.decode_words(ids)


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
    check_corpus(hypotheses, references)
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

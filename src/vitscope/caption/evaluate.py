"""Evaluating a captioner on a split: decode every image, score the captions against all of its
references (BLEU-1..4, CIDEr-D), and on Fashion-MNIST scenes the grounded measures (item accuracy,
exact match, attention grounding per layer and head).

    result = evaluate_captions(model, test_set, vocab, mean=train.mean, std=train.std, beam=3)
    result.metrics  # {'bleu1': ..., 'bleu4': ..., 'cider': ..., 'item_accuracy': ..., 'grounding': ...}

Decoding runs in batches; grounding is accumulated per batch (hits and counts), so no attention of
the whole split is ever held at once. Like `vitscope.translate.evaluate_translations`, it puts the model in
eval mode (and back), runs without gradients, and under bfloat16 autocast with `bf16`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vitscope.caption.dataset import CaptionDataset
from vitscope.caption.metrics import attention_grounding, score_captions
from vitscope.caption.scenes import exact_match, item_accuracy
from vitscope.data import normalize
from vitscope.sequence.decoding import decode
from vitscope.sequence.evaluation import evaluating
from vitscope.sequence.loss import masked_xent
from vitscope.sequence.vocab import PAD, Vocabulary


@dataclass
class CaptionEvaluation:
    metrics: dict  # JSON-ready: floats and lists of floats
    captions: list[list[str]]  # the generated words, per image


@torch.no_grad()
def evaluate_captions(model, dataset: CaptionDataset, vocab: Vocabulary, *, mean: Sequence[float],
                      std: Sequence[float], beam: int = 1, batch_size: int = 64, max_len: int | None = None,
                      length_penalty: float = 0.0, no_repeat_ngram_size: int = 0,
                      device: torch.device | str | None = None, bf16: bool = False) -> CaptionEvaluation:
    """Decode `dataset` (uint8 images, normalised here with the TRAINING mean/std) and score it, the model
    in eval mode. Metrics carry the decoding settings ('beam', ...) and 'loss', the teacher-forced
    cross-entropy of every reference (cut to the decoder's positions)."""
    with evaluating(model):
        return _evaluate(model, dataset, vocab, mean=mean, std=std, beam=beam, batch_size=batch_size,
                         max_len=max_len, length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                         device=device, bf16=bf16)


def _evaluate(model, dataset: CaptionDataset, vocab: Vocabulary, *, mean, std, beam, batch_size, max_len,
              length_penalty, no_repeat_ngram_size, device, bf16) -> CaptionEvaluation:
    device = torch.device(device) if device is not None else next(model.parameters()).device
    words: list[list[str]] = []
    hits_head = hits_layer = None
    hits_mean, counted = 0.0, 0
    xent_sum, xent_count = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        images = normalize(dataset.images[start:start + batch_size].to(device), mean, std)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            memory = model.encode(images)  # (b, N, De), shared by the decoding and the loss
            part = dataset.subset(range(start, min(start + batch_size, len(dataset))))
            index, tokens = part.pairs(vocab, max_len=model.max_len)
            out = model.teacher_forced(memory.index_select(0, index.to(device)), tokens.to(device))
            logits = out[0] if isinstance(out, tuple) else out  # the LSTM also returns its alignments
            tokens = tokens.to(device)
            xent_sum += float(masked_xent(logits, tokens, reduction="sum"))
            xent_count += int((tokens[:, 1:] != PAD).sum())
            out = decode(model, memory=memory, beam=beam, max_len=max_len, length_penalty=length_penalty,
                         no_repeat_ngram_size=no_repeat_ngram_size)
        batch_words = out.words(vocab)
        words += batch_words
        if dataset.scenes is not None:
            maps = [a[: int(n)].float().cpu() for a, n in zip(out.attention, out.lengths)]
            g = attention_grounding(batch_words, maps,
                                    dataset.scenes[start:start + batch_size], grid=tuple(model.grid),
                                    image_size=tuple(dataset.images.shape[-2:]),
                                    num_prefix_tokens=model.num_prefix_tokens)
            if g.count:
                hits_head = g.per_head * g.count + (0 if hits_head is None else hits_head)
                hits_layer = g.per_layer * g.count + (0 if hits_layer is None else hits_layer)
                hits_mean += g.mean * g.count
                counted += g.count
    metrics = score_captions(words, dataset.tokenized())
    metrics["loss"] = xent_sum / max(xent_count, 1)
    if dataset.scenes is not None:
        metrics["item_accuracy"] = item_accuracy(words, dataset.scenes)
        metrics["exact_match"] = exact_match(words, dataset.scenes)
        metrics["grounding"] = hits_mean / counted if counted else float("nan")
        metrics["grounding_per_layer"] = (hits_layer / counted).tolist() if counted else []
        metrics["grounding_per_head"] = (hits_head / counted).tolist() if counted else []
        metrics["grounding_words"] = counted
    metrics.update(beam=beam, length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                   images=len(dataset), mean_length=sum(map(len, words)) / max(len(words), 1))
    return CaptionEvaluation(metrics, words)

"""Decode a split with a translator and score it.

Translations come from captioning's decoding (greedy, or the standard beam search) with the encoder's states
as the memory and the source pads masked. Alignment accuracy is read teacher-forced, on the reference
translation, so every target word has its gold source word whatever the decoder would have written: the RNN's
additive attention, or each transformer decoder block's cross-attention per head (`alignment_per_head`
(L, H); `alignment` is the best head's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vitscope.sequence.decoding import decode
from vitscope.sequence.evaluation import evaluating
from vitscope.sequence.loss import masked_xent, trim_padding
from vitscope.sequence.vocab import PAD
from vitscope.translate.builders import ParallelSplit
from vitscope.translate.metrics import accuracy_by_length, alignment_accuracy, bleu4, exact_match, token_accuracy


@dataclass
class TranslationEvaluation:
    metrics: dict  # loss, exact_match, token_accuracy, bleu4, alignment (None without attention), ...
    translations: list[list[str]]
    by_length: dict[int, tuple[float, int]] = field(default_factory=dict)


def teacher_forced(model: nn.Module, src: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
    """Logits (B, T-1, V) and attention (B, T-1, N) for the RNN, (B, T-1, L, H, N) for the transformer."""
    if model.kind == "transformer":
        return model(src, tgt, return_weights=True)
    return model(src, tgt)


@torch.no_grad()
def evaluate_translations(model: nn.Module, split: ParallelSplit, tgt_vocab, *, beam: int = 1,
                          batch_size: int = 500, max_len: int | None = None, length_penalty: float = 0.0,
                          no_repeat_ngram_size: int = 0, device: torch.device | None = None,
                          bf16: bool = False) -> TranslationEvaluation:
    """Every sentence of `split` translated (beam 1: greedy; the other settings as `vitscope.sequence.decode`'s)
    and scored, as `evaluate_captions` scores a caption split: the model in eval mode (and back), no gradients,
    bfloat16 autocast with `bf16`."""
    device = device or torch.device("cpu")
    translations, loss_sum, words, hits, scored = [], 0.0, 0, None, 0
    with evaluating(model), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for s in range(0, len(split), batch_size):
            src = trim_padding(split.src[s : s + batch_size].to(device))
            tgt = trim_padding(split.tgt[s : s + batch_size].to(device))
            gold = split.gold[s : s + batch_size, : tgt.shape[1] - 1].to(device)
            logits, att = teacher_forced(model, src, tgt)
            loss_sum += float(masked_xent(logits, tgt, reduction="sum"))
            words += int((tgt[:, 1:] != PAD).sum())
            if model.has_attention:
                n = int((gold >= 0).sum())
                acc = alignment_accuracy(att.float(), gold) * n  # hits, per layer and head for the transformer
                hits = acc if hits is None else hits + acc
                scored += n
            out = decode(model, memory=model.encode(src), memory_padding=src == PAD, beam=beam, max_len=max_len,
                         length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
            translations += [tgt_vocab.decode_words(t) for t in out.tokens]
    references = [list(e.target) for e in split.examples]
    metrics = {"loss": loss_sum / max(words, 1), "exact_match": exact_match(translations, references),
               "token_accuracy": token_accuracy(translations, references), "bleu4": bleu4(translations, references),
               "alignment": None}
    if hits is not None:
        per = (hits / max(scored, 1)).float()
        metrics["alignment"] = float(per.max())
        if per.ndim == 2:
            layer, head = divmod(int(per.argmax()), per.shape[1])
            metrics["alignment_per_head"] = per.tolist()
            metrics["alignment_best_head"] = [layer, head]
            metrics["alignment_mean_heads"] = per.mean(1).tolist()
    metrics.update(beam=beam, length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
    by_length = accuracy_by_length(translations, references, [len(e.source) for e in split.examples])
    return TranslationEvaluation(metrics, translations, by_length)

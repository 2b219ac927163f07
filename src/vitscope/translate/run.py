"""A trained translator as `vitscope eval | translate` open it, and the report a finished translation run writes.

    run = open_translator("runs/translate_rnn")        # a run directory: best.safetensors, else last
    out = run.translate(["the dog small sees a cat"], beam=5)

A translation checkpoint is a safetensors file like the others: the weights, `translator` (its kind and config),
both vocabularies, the longest sentence it reads and the run's TrainConfig.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vitscope.errors import InputError
from vitscope.inspect.probes import run_probes
from vitscope.inspect.translate_explorer import translate_explorer_data, write_translate_page
from vitscope.kernels import apply
from vitscope.sequence.decoding import decode
from vitscope.sequence.loss import trim_padding
from vitscope.sequence.vocab import PAD, Vocabulary
from vitscope.translate.builders import (
    ParallelData,
    describe,
    encode_source,
    translator_from_dict,
    translator_to_dict,
)
from vitscope.translate.evaluate import teacher_forced
from vitscope.translate.metrics import alignment_accuracy
from vitscope.translate.plots import alignment_figure
from vitscope.weights.files import TRANSLATOR_KEY, check_finite, load_checked
from vitscope.weights.model_io import checkpoint_metadata, find_checkpoint, read_metadata

SOURCE_VOCAB_KEY = "vitscope.translate.source_vocab"
TARGET_VOCAB_KEY = "vitscope.translate.target_vocab"


def translation_metadata(model: nn.Module, data: ParallelData) -> dict[str, str]:
    return {TRANSLATOR_KEY: json.dumps(translator_to_dict(model)), SOURCE_VOCAB_KEY: data.src_vocab.to_json(),
            TARGET_VOCAB_KEY: data.tgt_vocab.to_json(), "max_words": str(data.max_words),
            "dataset": "synthetic_pair"}


@dataclass
class Translation:
    source: list[str]
    words: list[str]
    attention: torch.Tensor  # (T, N) or (T, L, H, N): row t for word t (and a last one for <eos>)
    score: float


@dataclass
class TranslatorRun:
    model: nn.Module  # eval mode
    src_vocab: Vocabulary
    tgt_vocab: Vocabulary
    max_words: int
    train_config: dict
    source: Path

    @property
    def description(self) -> str:
        return describe(self.model)

    @torch.no_grad()
    def translate(self, sentences: Sequence[Sequence[str]], *, beam: int = 1, max_len: int | None = None,
                  length_penalty: float = 0.0, no_repeat_ngram_size: int = 0) -> list[Translation]:
        """Each sentence (a list of words) translated, decoding as `vitscope.sequence.decode` does with these
        settings; an unknown word or an empty sentence is an InputError."""
        out = []
        for words in sentences:
            src = encode_source(list(words), self.src_vocab, self.max_words)
            d = decode(self.model, memory=self.model.encode(src), memory_padding=src == PAD, beam=beam,
                       max_len=max_len, length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
            target = self.tgt_vocab.decode_words(d.tokens[0])
            out.append(Translation(list(words), target, d.attention[0, : len(target) + 1], float(d.score[0])))
        return out


def is_translation_checkpoint(source: str | Path) -> bool:
    """Whether `source` (a run directory or a .safetensors file) holds a translator."""
    meta = checkpoint_metadata(source)
    return meta is not None and TRANSLATOR_KEY in meta


def open_translator(source: str | Path, *, kernels: bool = False) -> TranslatorRun:
    """The translator `source` (a run directory or its .safetensors file) holds, in eval mode; with `kernels`,
    vitscope's CPU kernels swapped in (as `open_captioner` and `open_model` do)."""
    from safetensors.torch import load_file

    ckpt = find_checkpoint(source)
    meta = read_metadata(ckpt) if ckpt.suffix == ".safetensors" else {}
    if TRANSLATOR_KEY not in meta:
        raise InputError(f"{source} is not a translation run (no {TRANSLATOR_KEY!r} in {ckpt.name}'s metadata); "
                         f"train one with vitscope train --task translate --preset translate_rnn")
    model = meta.build(TRANSLATOR_KEY, translator_from_dict)
    src_vocab = meta.build(SOURCE_VOCAB_KEY, Vocabulary.from_dict)
    tgt_vocab = meta.build(TARGET_VOCAB_KEY, Vocabulary.from_dict)
    max_words = meta.json("max_words", int)
    if max_words < 1:
        raise meta.refuse("max_words", f"holds {max_words}, not a number of words")
    config = meta.json("train_config", dict, {})
    state = load_file(str(ckpt))
    load_checked(model, state, str(ckpt))
    check_finite(state, str(ckpt))
    if kernels:
        apply(model)
    return TranslatorRun(model.eval(), src_vocab, tgt_vocab, max_words, config, ckpt)


# -- the report of a finished run ------------------------------------------------------------------------------
def teacher_forced_attention(model: nn.Module, data: ParallelData, index: int) -> torch.Tensor:
    """One test sentence's attention on its reference translation, (T, N) or (T, L, H, N), <eos>'s row left out."""
    e = data.test.examples[index]
    src, tgt = trim_padding(data.test.src[index : index + 1]), trim_padding(data.test.tgt[index : index + 1])
    with torch.no_grad():
        _, att = teacher_forced(model.eval(), src, tgt)
    return att[0, : len(e.target)]


def best_head(attention: torch.Tensor, gold: torch.Tensor) -> tuple[int, int]:
    """The (layer, head) of a transformer whose attention (T, L, H, N) peaks on the gold words most often."""
    per = alignment_accuracy(attention[None], gold[None])
    return divmod(int(per.argmax()), per.shape[1])


def pick_sentence(data: ParallelData, words: int = 14) -> int:
    """A test sentence that shows reordering well: about `words` long, with adjectives and a two-word verb."""
    def score(i: int) -> tuple:
        e = data.test.examples[i]
        crossing = sum(a > b for a, b in zip(e.alignment, e.alignment[1:]))
        return (-abs(len(e.source) - words), crossing, len(e.target) - len(e.source), -i)

    return max(range(min(len(data.test), 200)), key=score)


def write_translation_report(run_dir: Path, model: nn.Module, data: ParallelData, *, sentences: int,
                             title: str) -> list[Path]:
    """alignment.png (one test sentence's heatmap, teacher-forced on the reference; a transformer's best head)
    and translations.html (the explorer over `sentences` test sentences, greedy translations)."""
    written = []
    if model.has_attention:
        i = pick_sentence(data)
        e = data.test.examples[i]
        att = teacher_forced_attention(model, data, i)
        gold = torch.tensor(e.alignment)
        label = ""
        if att.ndim == 4:
            layer, head = best_head(att, gold)
            att, label = att[:, layer, head], f" (layer {layer}, head {head})"
        alignment_figure(e.source, e.target, att, gold=e.alignment, title=f"{title}{label}",
                         path=run_dir / "alignment.png")
        written.append(run_dir / "alignment.png")
    n = min(sentences, len(data.test))
    examples = data.test.examples[:n]
    run = TranslatorRun(model, data.src_vocab, data.tgt_vocab, data.max_words, {}, run_dir)
    results = run.translate([e.source for e in examples])
    page = translate_explorer_data([r.source for r in results], [r.words for r in results],
                                   [r.attention for r in results], gold=[e.alignment for e in examples],
                                   references=[e.target for e in examples], probes=run_probes(run_dir))
    write_translate_page(page, run_dir / "translations.html", title=title)
    written.append(run_dir / "translations.html")
    return written

"""The language pair as tensors, and the translators by name.

    data = ParallelData.build(make_pair(seed=0))
    data.train.src (S, N) source ids, <pad> on the right;  data.train.tgt (S, T) <bos> ... <eos> <pad>
    data.train.gold (S, T-1) the source position of target word t (row t predicts tgt[:, t+1]), -1 elsewhere
    model = build_translator("rnn", data, {"hidden_dim": 128})

Both vocabularies are built from the training sentences only (vitscope.sequence.vocab.Vocabulary, with its
`<pad>` `<bos>` `<eos>` `<unk>` ids, so captioning's decoding reads the translators' output as it reads captions').
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from vitscope.errors import ConfigError, InputError
from vitscope.sequence.vocab import PAD, Vocabulary
from vitscope.translate.language import Example, LanguagePair
from vitscope.translate.rnn import RNNTranslator, RNNTranslatorConfig
from vitscope.translate.transformer import TransformerTranslator, TransformerTranslatorConfig

TranslatorKind = Literal["rnn", "transformer"]
TRANSLATORS = {"rnn": (RNNTranslator, RNNTranslatorConfig),
               "transformer": (TransformerTranslator, TransformerTranslatorConfig)}


@dataclass
class ParallelSplit:
    examples: list[Example]
    src: Tensor  # (S, N) int64
    tgt: Tensor  # (S, T) int64
    gold: Tensor  # (S, T-1) int64, -1 where no target word is written

    def __len__(self) -> int:
        return len(self.examples)


@dataclass
class ParallelData:
    train: ParallelSplit
    test: ParallelSplit
    src_vocab: Vocabulary
    tgt_vocab: Vocabulary
    max_words: int

    @classmethod
    def build(cls, pair: LanguagePair) -> ParallelData:
        src_vocab = Vocabulary.build([e.source for e in pair.train])
        tgt_vocab = Vocabulary.build([e.target for e in pair.train])
        split = lambda examples: tensors(examples, src_vocab, tgt_vocab)  # noqa: E731
        return cls(split(pair.train), split(pair.test), src_vocab, tgt_vocab, pair.max_words)

    @property
    def max_target_len(self) -> int:
        """The decoder's positions: `<bos>`, twice the longest source (no word has more than two target words)
        and `<eos>`."""
        return 2 * self.max_words + 2


def tensors(examples: Sequence[Example], src_vocab: Vocabulary, tgt_vocab: Vocabulary) -> ParallelSplit:
    n = max(len(e.source) for e in examples)
    t = max(len(e.target) for e in examples) + 2
    src = torch.full((len(examples), n), PAD, dtype=torch.long)
    tgt = torch.full((len(examples), t), PAD, dtype=torch.long)
    gold = torch.full((len(examples), t - 1), -1, dtype=torch.long)
    for i, e in enumerate(examples):
        src[i, : len(e.source)] = torch.tensor(src_vocab.encode(e.source, bos=False, eos=False))
        ids = tgt_vocab.encode(e.target)
        tgt[i, : len(ids)] = torch.tensor(ids)
        gold[i, : len(e.alignment)] = torch.tensor(e.alignment)
    return ParallelSplit(list(examples), src, tgt, gold)


def encode_source(words: Sequence[str], vocab: Vocabulary, max_words: int) -> Tensor:
    """One sentence's ids (1, N); a word the vocabulary lacks, an empty or too long sentence is an InputError."""
    if not words:
        raise InputError("the sentence is empty; give some words, e.g. \"the dog sees a cat\"")
    unknown = [w for w in words if w not in vocab]
    if unknown:
        raise InputError(f"unknown word{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: the "
                         f"translator knows the {len(vocab) - 4} words of its training sentences, e.g. "
                         f"{', '.join(vocab.words[4:9])}")
    if len(words) > max_words:
        raise InputError(f"the sentence has {len(words)} words; the translator reads at most {max_words}")
    return torch.tensor([vocab.encode(words, bos=False, eos=False)])


def build_translator(kind: str, data: ParallelData, overrides: dict | None = None, *,
                     label_smoothing: float = 0.0) -> nn.Module:
    """A translator of `kind` for `data`'s vocabularies and lengths, with config `overrides`."""
    if kind not in TRANSLATORS:
        raise ConfigError(f"translator must be one of {', '.join(TRANSLATORS)}, got {kind!r}")
    model_cls, config_cls = TRANSLATORS[kind]
    config = config_cls(src_vocab_size=len(data.src_vocab), tgt_vocab_size=len(data.tgt_vocab),
                        max_len=data.max_target_len, max_src_len=data.max_words, label_smoothing=label_smoothing,
                        **(overrides or {}))
    return model_cls(config)


def translator_to_dict(model: nn.Module) -> dict:
    return {"kind": model.kind, "config": model.config.to_dict()}


def translator_from_dict(d: dict) -> nn.Module:
    model_cls, config_cls = TRANSLATORS[d["kind"]]
    return model_cls(config_cls.from_dict(d["config"]))


def describe(model: nn.Module) -> str:
    """'RNN with attention', 'RNN without attention' or 'transformer'."""
    if model.kind == "transformer":
        return "transformer"
    return "RNN with attention" if model.has_attention else "RNN without attention"

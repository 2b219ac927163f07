"""A captioning split in memory: uint8 images and, per image, its reference captions.

Every source (the COCO / Karpathy / Flickr8k readers, Fashion-MNIST scenes) returns a
`CaptionDataset`. Training reads (image, caption) pairs: `pairs(vocab, max_len)` turns every
reference of every image into one row of token ids, so an epoch sees each reference once, as
COCO-trained captioners do; evaluation groups all references of an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vitscope.errors import InputError
from vitscope.sequence.vocab import MAX_WORDS, Vocabulary, tokenize


@dataclass
class CaptionDataset:
    """images uint8 (N, C, H, W); captions[i] the raw reference captions of image i (at least one).

    `scenes` (Fashion-MNIST scenes only) records where every item is; `names` are file names or ids.
    `mean`/`std` per channel on the 0..1 scale, of the training split, for normalising.
    """

    images: Tensor
    captions: list[list[str]]
    name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    names: list[str] = field(default_factory=list)
    scenes: list | None = None

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.ndim != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {self.images.dtype} {tuple(self.images.shape)}")
        if len(self.captions) != self.images.shape[0]:
            raise InputError(f"{self.images.shape[0]} images but captions for {len(self.captions)}")
        for i, caps in enumerate(self.captions):
            name = self.names[i] if i < len(self.names) else i
            if not isinstance(caps, list):
                raise InputError(f"image {name} has captions {caps!r:.40}; give a list of caption strings")
            if not caps:
                raise InputError(f"image {name} has no caption")
            bad = next((c for c in caps if not isinstance(c, str) or not c.strip()), None)
            if bad is not None:
                raise InputError(f"image {name} has the caption {bad!r:.40}; each caption is a non-empty string")
        if self.scenes is not None and len(self.scenes) != len(self.captions):
            raise InputError(f"{len(self.captions)} images but {len(self.scenes)} scene records")
        self.images = self.images.contiguous()

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def image_shape(self) -> tuple[int, int, int]:
        c, h, w = self.images.shape[1:]
        return (c, h, w)

    def tokenized(self) -> list[list[list[str]]]:
        """Every reference as words, grouped per image: what the metrics compare against."""
        return [[tokenize(c) for c in caps] for caps in self.captions]

    def build_vocab(self, *, min_count: int = 1, max_words: int = MAX_WORDS) -> Vocabulary:
        """The vocabulary of these captions; call it on the TRAINING split only. Refuses one with no
        word or past `max_words`, and warns when most words become `<unk>` (`Vocabulary.build`)."""
        return Vocabulary.build((c for caps in self.captions for c in caps), min_count=min_count,
                                max_words=max_words)

    def pairs(self, vocab: Vocabulary, *, max_len: int | None = None) -> tuple[Tensor, Tensor]:
        """(image_index (P,) int64, tokens (P, T) int64): one row per reference caption, `<bos>` ...
        `<eos>` then `<pad>`, cut to `max_len` positions."""
        index = torch.tensor([i for i, caps in enumerate(self.captions) for _ in caps], dtype=torch.long)
        tokens = vocab.encode_batch([c for caps in self.captions for c in caps], max_len=max_len)
        return index, tokens

    def subset(self, indices: Sequence[int] | Tensor) -> CaptionDataset:
        idx = torch.as_tensor(indices, dtype=torch.long)
        pick = idx.tolist()
        return CaptionDataset(
            images=self.images[idx], captions=[self.captions[i] for i in pick], name=self.name,
            mean=self.mean, std=self.std, names=[self.names[i] for i in pick] if self.names else [],
            scenes=[self.scenes[i] for i in pick] if self.scenes is not None else None,
        )

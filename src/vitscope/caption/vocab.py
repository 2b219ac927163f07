"""Words and their ids: the tokeniser and the vocabulary a captioner reads and writes.

Tokenisation is word-level: lower-cased, punctuation split off as tokens of its own, words with an
inner hyphen or apostrophe kept whole ("t-shirt", "man's"), as COCO's reference tokens have them.

The vocabulary is built from the training split's captions only (a word seen only in the test
captions must not get an id: it would leak the test set into the model's output layer), keeps the
words seen at least `min_count` times, and starts with the four specials

    <pad>=0  <bos>=1  <eos>=2  <unk>=3

so a batch can be padded with zeros and every checkpoint agrees on them. `to_dict` / `from_dict`
give a JSON-able record that travels with the checkpoint (in safetensors metadata or a JSON file
beside the weights); `fingerprint` names its content, so a mismatched vocabulary is caught.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from vitscope.errors import ConfigError, InputError

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
FORMAT = "vitscope.caption.vocab/1"

# A word: letters/digits, with inner hyphens or apostrophes; anything else that is not space is a
# punctuation token of its own.
_TOKEN = re.compile(r"[^\W_]+(?:['\-][^\W_]+)*|[^\w\s]|_")


def tokenize(text: str) -> list[str]:
    """'A T-shirt, top-left.' -> ['a', 't-shirt', ',', 'top-left', '.']"""
    return _TOKEN.findall(text.lower())


def is_punctuation(word: str) -> bool:
    return _TOKEN.fullmatch(word) is not None and not any(ch.isalnum() for ch in word)


class Vocabulary:
    """Word <-> id, specials first. Build with `Vocabulary.build(train_captions, min_count=...)`."""

    def __init__(self, words: Sequence[str]):
        words = list(words)
        if tuple(words[:4]) != SPECIALS:
            raise InputError(f"a vocabulary starts with {SPECIALS}, got {words[:4]}")
        if len(set(words)) != len(words):
            dup = sorted(w for w, n in Counter(words).items() if n > 1)
            raise InputError(f"a vocabulary lists every word once; repeated: {dup[:5]}")
        self.words = words
        self.index = {w: i for i, w in enumerate(words)}

    @classmethod
    def build(cls, captions: Iterable[str | Sequence[str]], *, min_count: int = 1) -> Vocabulary:
        """From the TRAINING captions only (raw strings or token lists). Words seen fewer than
        `min_count` times become <unk>. Order: count, most frequent first, then alphabetical, so
        the same captions give the same ids on every machine."""
        if min_count < 1:
            raise ConfigError(f"min_count must be at least 1, got {min_count}")
        counts: Counter[str] = Counter()
        for c in captions:
            counts.update(tokenize(c) if isinstance(c, str) else c)
        for s in SPECIALS:
            counts.pop(s, None)
        kept = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
        return cls([*SPECIALS, *kept])

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: str) -> bool:
        return word in self.index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.words == other.words

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} words, fingerprint {self.fingerprint[:12]})"

    # -- ids ---------------------------------------------------------------------------------------
    def encode(self, caption: str | Sequence[str], *, bos: bool = True, eos: bool = True) -> list[int]:
        """'a bag' -> [<bos>, id('a'), id('bag'), <eos>]; unknown words map to <unk>."""
        words = tokenize(caption) if isinstance(caption, str) else caption
        ids = [self.index.get(w, UNK) for w in words]
        return [BOS] * bos + ids + [EOS] * eos

    def encode_batch(self, captions: Sequence[str | Sequence[str]], *, max_len: int | None = None) -> Tensor:
        """(B, T) int64 with <bos> ... <eos> and <pad> after it. `max_len` cuts longer captions
        (keeping <eos> last) so a batch fits the decoder's positions."""
        if max_len is not None and max_len < 2:
            raise ConfigError(f"max_len must leave room for <bos> and <eos>, got {max_len}")
        rows = [self.encode(c) for c in captions]
        if max_len is not None:
            rows = [r if len(r) <= max_len else r[: max_len - 1] + [EOS] for r in rows]
        out = torch.full((len(rows), max(map(len, rows), default=2)), PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return out

    def decode_words(self, ids: Sequence[int] | Tensor) -> list[str]:
        """Ids -> words, cut at the first <eos>, with <bos> and <pad> left out."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        words = []
        for i in ids:
            if i == EOS:
                break
            if i in (PAD, BOS):
                continue
            words.append(self.words[i] if 0 <= i < len(self.words) else SPECIALS[UNK])
        return words

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Ids -> a readable caption: words joined by spaces, no space before , ; : . ! ?"""
        return detokenize(self.decode_words(ids))

    # -- travelling with checkpoints ---------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 of the word list: two vocabularies with the same ids have the same fingerprint."""
        return hashlib.sha256("\n".join(self.words).encode()).hexdigest()

    def to_dict(self) -> dict:
        return {"format": FORMAT, "words": list(self.words), "sha256": self.fingerprint}

    @classmethod
    def from_dict(cls, d: dict) -> Vocabulary:
        if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("words"), list):
            raise InputError(f"not a vitscope caption vocabulary (want format {FORMAT!r} with a 'words' list)")
        vocab = cls(d["words"])
        if "sha256" in d and d["sha256"] != vocab.fingerprint:
            raise InputError("the vocabulary's word list does not match its recorded sha256; the file is damaged")
        return vocab

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Vocabulary:
        return cls.from_dict(json.loads(text))


_CLOSING = set(",;:.!?)]}'")
_OPENING = set("([{")


def detokenize(words: Sequence[str]) -> str:
    """['a', 'bag', '(', 'top', ')', '.'] -> 'a bag (top).'"""
    text, glue = "", True  # glue: the next word attaches without a space
    for w in words:
        text += w if glue or w in _CLOSING else " " + w
        glue = w in _OPENING
    return text

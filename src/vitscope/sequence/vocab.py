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
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from vitscope.errors import ConfigError, InputError

PAD, BOS, EOS, UNK = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
FORMAT = "vitscope.caption.vocab/1"  # the name it was first written under: saved checkpoints carry it
# The most words a built vocabulary may hold. COCO's training captions hold tens of thousands of
# distinct words; a vocabulary past this is a broken caption file (each word an output row and an
# embedding row: 200,000 words took 2.1 GB), so it is refused with the min_count that fits.
MAX_WORDS = 100_000

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
    def build(cls, captions: Iterable[str | Sequence[str]], *, min_count: int = 1,
              max_words: int = MAX_WORDS) -> Vocabulary:
        """From the TRAINING captions only (raw strings or token lists). Words seen fewer than
        `min_count` times become `<unk>`. Order: count, most frequent first, then alphabetical, so
        the same captions give the same ids on every machine.

        Refused (ConfigError, one line saying what to set): a vocabulary with no word, only
        punctuation, and one past `max_words`. Warned: when most training tokens become `<unk>`."""
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ConfigError(f"vocab_min_count (--vocab-min-count) must be a whole number of at least 1, "
                              f"got {min_count!r}")
        counts: Counter[str] = Counter()
        for c in captions:
            counts.update(tokenize(c) if isinstance(c, str) else c)
        for s in SPECIALS:
            counts.pop(s, None)
        kept = sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))
        _check_kept(counts, kept, min_count, max_words)
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
        """'a bag' -> [`<bos>`, id('a'), id('bag'), `<eos>`]; unknown words map to `<unk>`."""
        words = tokenize(caption) if isinstance(caption, str) else caption
        ids = [self.index.get(w, UNK) for w in words]
        return [BOS] * bos + ids + [EOS] * eos

    def encode_batch(self, captions: Sequence[str | Sequence[str]], *, max_len: int | None = None) -> Tensor:
        """(B, T) int64 with `<bos>` ... `<eos>` and `<pad>` after it. `max_len` cuts longer captions
        (keeping `<eos>` last) so a batch fits the decoder's positions."""
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
        """Ids -> words, cut at the first `<eos>`, with `<bos>` and `<pad>` left out."""
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


def _check_kept(counts: Counter[str], kept: list[str], min_count: int, max_words: int) -> None:
    """Refuse a vocabulary that cannot caption (no word, or too many to hold); warn when most
    training tokens fall out of it."""
    setting = "vocab_min_count (--vocab-min-count)"
    words = [w for w, _ in counts.most_common() if not is_punctuation(w)]
    if not words:
        raise ConfigError("the training captions hold no word (only punctuation or nothing); "
                          "give captions with words")
    if not any(not is_punctuation(w) for w in kept):
        best = words[0]
        raise ConfigError(f"{setting} {min_count:,} keeps no word: the most frequent training word, {best!r}, is seen "
                          f"{counts[best]:,} times, so every caption would be <unk>; set it to at most "
                          f"{counts[best]:,} (1 keeps every word)")
    if len(kept) > max_words:
        # the smallest min_count that keeps at most max_words words
        enough = sorted(counts.values(), reverse=True)[max_words] + 1
        keeps = sum(n >= enough for n in counts.values())
        fix = (f"raise {setting} to {enough:,}, which keeps {keeps:,} words, or check the captions" if keeps
               else "check the captions: nearly every word in them is different")
        raise ConfigError(f"the training captions give {len(kept):,} words at {setting} {min_count:,}, more than the "
                          f"{max_words:,} a vocabulary may hold; {fix}")
    total = sum(counts.values())
    unknown = total - sum(counts[w] for w in kept)
    if unknown > total / 2:
        warnings.warn(f"{unknown / total:.0%} of the training captions' words become <unk> at {setting} "
                      f"{min_count:,} (it keeps {len(kept):,} of {len(counts):,} distinct words), so the captioner "
                      "learns to say <unk>; lower it", stacklevel=3)


_CLOSING = set(",;:.!?)]}'")
_OPENING = set("([{")


def detokenize(words: Sequence[str]) -> str:
    """['a', 'bag', '(', 'top', ')', '.'] -> 'a bag (top).'"""
    text, glue = "", True  # glue: the next word attaches without a space
    for w in words:
        text += w if glue or w in _CLOSING else " " + w
        glue = w in _OPENING
    return text

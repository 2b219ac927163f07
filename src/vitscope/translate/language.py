"""A synthetic language pair whose word order differs by rule, with the gold alignment of every target word.

The source reads like English with its adjectives after the noun (as in French); the target is verb-final
(subject, object, adverb, verb, as in Japanese or Turkish) with its adjectives before the noun, in mirror order:

    source  the dog small black sees a cat today and the king helps every child
    target  lo nor pik tolu un mira oje mi e lo taro ogni beko ajo
    gold    0  3   2   1    5  6    7   4  8 9  10   12   13   11     (target word -> source position)

Clause:  source  NP_subject VERB NP_object [ADVERB]      target  NP_subject' NP_object' [ADVERB'] VERB'
NP:      source  [DET] NOUN ADJ{0,2}                     target  [DET'] ADJ'{reversed} NOUN'
Sentence: clauses joined by a conjunction, the same in both. Some verbs and adverbs are two target words
("watches" -> "longa mi"): both align to the one source word. Every target word aligns to exactly one
source word, so attention's peak can be scored against it (`Example.alignment`).

`make_pair(seed, ...)` draws distinct sentences from a seeded generator and splits them, so train and test
never share a sentence and the same seed gives the same pair on every machine. `rule_translate` parses a
source sentence and translates it by the rules: the tests check every generated example against it.
`grammar_note` says why a sentence is not one the grammar makes, and its grammatical order where there is one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from vitscope.errors import ConfigError, InputError

# source word -> its target word(s)
DETERMINERS = {"the": ("lo",), "a": ("un",), "every": ("ogni",), "this": ("si",)}
NOUNS = {"cat": ("mira",), "dog": ("tolu",), "bird": ("pesa",), "fish": ("koro",), "horse": ("wani",),
         "child": ("beko",), "woman": ("sula",), "man": ("dano",), "farmer": ("gilo",), "teacher": ("rumi",),
         "king": ("taro",), "queen": ("lena",), "river": ("vesu",), "house": ("kasa",), "tree": ("polo",),
         "stone": ("mako",), "book": ("lito",), "ship": ("naru",), "city": ("feso",), "garden": ("hoti",)}
ADJECTIVES = {"big": ("gan",), "small": ("pik",), "red": ("ruk",), "black": ("nor",), "white": ("bel",),
              "old": ("sen",), "young": ("jun",), "happy": ("fel",), "quiet": ("sil",), "fast": ("vel",),
              "green": ("ver",), "tall": ("tol",)}
VERBS = {"sees": ("mi",), "likes": ("ama",), "follows": ("sega",), "finds": ("tova",), "helps": ("ajo",),
         "carries": ("porta",), "watches": ("longa", "mi"), "visits": ("va", "ke"), "paints": ("pinta",),
         "hears": ("oda",), "teaches": ("da", "lerno"), "calls": ("voka",)}
ADVERBS = {"today": ("oje",), "slowly": ("lente",), "often": ("sovent",), "again": ("re", "ve"),
           "quietly": ("kalme",), "yesterday": ("ieri",)}
CONJUNCTIONS = {"and": ("e",), "but": ("ma",)}
LEXICON = {**DETERMINERS, **NOUNS, **ADJECTIVES, **VERBS, **ADVERBS, **CONJUNCTIONS}


@dataclass(frozen=True)
class Example:
    """One sentence pair: source and target words, and alignment[j], the source position target word j
    translates."""

    source: tuple[str, ...]
    target: tuple[str, ...]
    alignment: tuple[int, ...]


@dataclass(frozen=True)
class LanguagePair:
    train: list[Example]
    test: list[Example]
    seed: int
    max_words: int


# -- drawing sentences ---------------------------------------------------------------------------------
def _noun_phrase(rng: random.Random) -> list[str]:
    words = [rng.choice(list(DETERMINERS))] if rng.random() < 0.7 else []
    words.append(rng.choice(list(NOUNS)))
    words += rng.sample(list(ADJECTIVES), rng.choice((0, 0, 1, 1, 2)))
    return words


def _clause(rng: random.Random) -> list[str]:
    words = _noun_phrase(rng) + [rng.choice(list(VERBS))] + _noun_phrase(rng)
    return words + [rng.choice(list(ADVERBS))] if rng.random() < 0.35 else words


def draw_sentence(rng: random.Random, max_words: int) -> tuple[str, ...]:
    """One source sentence of 1 to 3 clauses and at most `max_words` words (longer draws are redrawn)."""
    while True:
        words = _clause(rng)
        for _ in range(rng.choice((0, 1, 1, 2))):
            words += [rng.choice(list(CONJUNCTIONS))] + _clause(rng)
        if len(words) <= max_words:
            return tuple(words)


# -- translating by the rules ----------------------------------------------------------------------------
def _parse_noun_phrase(words: Sequence[str], i: int) -> tuple[list[int], int]:
    """The positions of the noun phrase starting at i, in target order, and where it ends."""
    det = [i] if i < len(words) and words[i] in DETERMINERS else []
    i += len(det)
    if i >= len(words) or words[i] not in NOUNS:
        raise InputError(f"expected a noun at word {i + 1} of {' '.join(words)!r}")
    noun, i = i, i + 1
    adjectives = []
    while i < len(words) and words[i] in ADJECTIVES:
        adjectives.append(i)
        i += 1
    return det + adjectives[::-1] + [noun], i


def rule_translate(source: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The target words of a source sentence by the rules, and each one's source position. Raises InputError
    on a sentence the grammar does not make."""
    order, i = [], 0
    while True:
        subject, i = _parse_noun_phrase(source, i)
        if i >= len(source) or source[i] not in VERBS:
            raise InputError(f"expected a verb at word {i + 1} of {' '.join(source)!r}")
        verb = i
        obj, i = _parse_noun_phrase(source, i + 1)
        adverb = [i] if i < len(source) and source[i] in ADVERBS else []
        i += len(adverb)
        order += subject + obj + adverb + [verb]
        if i == len(source):
            break
        if source[i] not in CONJUNCTIONS:
            raise InputError(f"expected a conjunction or the end at word {i + 1} of {' '.join(source)!r}")
        order.append(i)
        i += 1
    target, alignment = [], []
    for pos in order:
        for word in LEXICON[source[pos]]:
            target.append(word)
            alignment.append(pos)
    return tuple(target), tuple(alignment)


def grammar_note(source: Sequence[str]) -> str | None:
    """None for a sentence the grammar makes; else why it is not one, with the grammatical order where putting
    each adjective after its noun gives one (`the old king sees a cat` -> `the king old sees a cat`). For a
    translator's user, not a refusal: the model may still be asked what it makes of the sentence."""
    try:
        rule_translate(source)
        return None
    except InputError as e:
        reason = str(e).split(" of '")[0]
    reordered = _adjectives_after_nouns(source)
    if reordered != list(source):
        try:
            rule_translate(reordered)
            return f'adjectives follow their noun: "{" ".join(reordered)}"'
        except InputError:
            pass
    return reason


def _adjectives_after_nouns(words: Sequence[str]) -> list[str]:
    """`words` with each run of adjectives before a noun moved after it (in the same order)."""
    out: list[str] = []
    held: list[str] = []
    for w in words:
        if w in ADJECTIVES:
            held.append(w)
            continue
        if w in NOUNS:
            out += [w, *held]
        else:
            out += [*held, w]
        held = []
    return out + held


def make_example(source: Sequence[str]) -> Example:
    target, alignment = rule_translate(source)
    return Example(tuple(source), target, alignment)


# -- the pair ----------------------------------------------------------------------------------------------
def make_pair(seed: int = 0, *, train_size: int = 20_000, test_size: int = 1_000, max_words: int = 20) -> LanguagePair:
    """`train_size` + `test_size` distinct sentences drawn with `seed`, shuffled and split: no test sentence
    is in the training set."""
    if max_words < 3:
        raise ConfigError(f"max_words must be at least 3 (subject, verb, object), got {max_words}")
    rng = random.Random(seed)
    seen: dict[tuple[str, ...], None] = {}
    tries = 0
    while len(seen) < train_size + test_size:
        seen[draw_sentence(rng, max_words)] = None
        tries += 1
        if tries > 20 * (train_size + test_size) + 1000:
            raise ConfigError(f"could not draw {train_size + test_size} distinct sentences of at most {max_words} "
                              f"words; ask for fewer or allow longer sentences")
    sentences = list(seen)
    rng.shuffle(sentences)
    examples = [make_example(s) for s in sentences]
    return LanguagePair(examples[test_size:], examples[:test_size], seed, max_words)


def split_sentence(text: str) -> list[str]:
    """A sentence as the language's words: lower-cased, split on white space, a final full stop dropped."""
    return text.lower().replace(".", " ").split()

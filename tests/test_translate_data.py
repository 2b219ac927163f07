"""The synthetic language pair: the same seed gives the same sentences, train and test never share one, every
gold alignment follows the rules, and the metrics score hand-made cases as defined."""

from __future__ import annotations

import pytest
import torch

from vitscope.errors import InputError
from vitscope.translate.builders import ParallelData, encode_source
from vitscope.translate.language import LEXICON, NOUNS, VERBS, make_example, make_pair, rule_translate
from vitscope.translate.metrics import (
    accuracy_by_length,
    alignment_accuracy,
    bleu4,
    exact_match,
    token_accuracy,
)


@pytest.fixture(scope="module")
def pair():
    return make_pair(3, train_size=3000, test_size=300, max_words=20)


def test_the_same_seed_draws_the_same_pair_and_another_seed_another(pair):
    again = make_pair(3, train_size=3000, test_size=300, max_words=20)
    assert again.train == pair.train and again.test == pair.test
    other = make_pair(4, train_size=3000, test_size=300, max_words=20)
    assert sum(a == b for a, b in zip(other.test, pair.test)) < 5


def test_train_and_test_share_no_sentence(pair):
    train = {e.source for e in pair.train}
    assert len(train) == 3000
    assert not train & {e.source for e in pair.test}


def test_lengths_run_from_3_to_max_words(pair):
    lengths = [len(e.source) for e in pair.train]
    assert min(lengths) == 3 and max(lengths) == 20
    assert len(set(lengths)) == 18  # every length in between occurs


def test_every_gold_alignment_follows_the_rules(pair):
    for e in pair.train + pair.test:
        assert len(e.alignment) == len(e.target)
        # each target word is (one of) the translation(s) of its gold source word, and every source word is used
        assert all(w in LEXICON[e.source[a]] for w, a in zip(e.target, e.alignment))
        assert sorted(set(e.alignment)) == list(range(len(e.source)))
        assert rule_translate(e.source) == (e.target, e.alignment)


def test_a_hand_checked_sentence():
    e = make_example("the dog small black watches a cat today and the king helps every child".split())
    assert " ".join(e.target) == "lo nor pik tolu un mira oje longa mi e lo taro ogni beko ajo"
    # adjectives before the noun in mirror order, the verb last in its clause, "watches" two words
    assert e.alignment == (0, 3, 2, 1, 5, 6, 7, 4, 4, 8, 9, 10, 12, 13, 11)
    verbs = [i for i, w in enumerate(e.source) if w in VERBS]
    nouns = [i for i, w in enumerate(e.source) if w in NOUNS]
    assert verbs == [4, 11] and nouns == [1, 6, 10, 13]


def test_a_sentence_the_grammar_does_not_make_is_refused():
    with pytest.raises(InputError, match="expected a verb"):
        rule_translate("the dog cat".split())


def test_tensors_hold_the_examples(pair):
    data = ParallelData.build(pair)
    e, i = pair.test[7], 7
    assert data.src_vocab.decode_words(data.test.src[i]) == list(e.source)
    assert data.tgt_vocab.decode_words(data.test.tgt[i]) == list(e.target)
    assert data.test.gold[i, : len(e.target)].tolist() == list(e.alignment)
    assert (data.test.gold[i, len(e.target):] == -1).all()  # <eos> and pads have no gold word
    with pytest.raises(InputError, match="unknown word 'dgo'"):
        encode_source(["the", "dgo"], data.src_vocab, 20)
    with pytest.raises(InputError, match="empty"):
        encode_source([], data.src_vocab, 20)


# -- metrics on hand-made cases ------------------------------------------------------------------------------
def test_exact_match_and_token_accuracy():
    refs = [["a", "b", "c"], ["d", "e"], ["f"]]
    hyps = [["a", "b", "c"], ["d", "x"], ["g", "f"]]
    assert exact_match(hyps, refs) == pytest.approx(1 / 3)
    assert token_accuracy(hyps, refs) == pytest.approx(4 / 6)  # a b c d right; e and f at the wrong place
    long = [["lo", "nor", "tolu", "un", "mira", "mi"], ["un", "koro", "lo", "taro", "oje", "ajo"]]
    assert bleu4(long, long) == pytest.approx(1.0, abs=1e-6)
    assert bleu4([long[0], long[0]], long) < 0.6
    by = accuracy_by_length(hyps, refs, [3, 2, 2])
    assert by == {2: (0.0, 2), 3: (1.0, 1)}


def test_alignment_accuracy_scores_the_peaks_against_gold():
    att = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3], [1 / 3, 1 / 3, 1 / 3]]])  # (1, 4, 3)
    gold = torch.tensor([[0, 2, 0, -1]])  # the last step (<eos>) is not scored
    assert float(alignment_accuracy(att, gold)) == pytest.approx(2 / 3)
    per_head = torch.stack([att, att.flip(-1)], 2)[:, :, None]  # (1, 4, L=1, H=2, 3)
    out = alignment_accuracy(per_head, gold)
    assert out.shape == (1, 2)
    assert out.tolist() == [[pytest.approx(2 / 3), pytest.approx(0.0)]]

"""The vocabulary's limits: a min_count that keeps no word and one past MAX_WORDS are refused in one line
that says which min_count to set; most training words becoming <unk> is said once. And a CaptionDataset
refuses captions that are not strings."""

from __future__ import annotations

import pytest
import torch

from helpers import raises_one_line
from vitscope.caption.dataset import CaptionDataset
from vitscope.errors import ConfigError
from vitscope.sequence.vocab import MAX_WORDS, Vocabulary


def _raises(call, *fragments, error=ConfigError) -> str:
    return raises_one_line(call, *fragments, error=error)


def test_a_min_count_that_keeps_no_word_is_refused_with_what_to_set():
    captions = ["a grey square .", "a grey box .", "a square ."]
    _raises(lambda: Vocabulary.build(captions, min_count=1_000_000), "--vocab-min-count", "1,000,000 keeps no word",
            "'a', is seen 3 times", "set it to at most 3")
    # punctuation alone is no vocabulary: '.' is seen 3 times, 'a' too, but min_count 4 keeps neither
    _raises(lambda: Vocabulary.build([*captions, "."], min_count=4), "keeps no word", "at most 3")
    _raises(lambda: Vocabulary.build(["...", "!"]), "hold no word")
    _raises(lambda: Vocabulary.build(captions, min_count=0), "at least 1")


def test_a_vocabulary_of_mostly_unknown_words_warns(recwarn):
    captions = ["a grey square", "a grey box", "one red circle", "two blue stars"]  # 'a', 'grey' twice, 8 once
    with pytest.warns(UserWarning, match=r"67% of the training captions' words become <unk> at .*--vocab-min-count"
                                         r"\) 2 \(it keeps 2 of 10 distinct words\)"):
        Vocabulary.build(captions, min_count=2)
    recwarn.clear()
    Vocabulary.build(captions, min_count=1)  # nothing unknown, nothing said
    assert not [w for w in recwarn if "<unk>" in str(w.message)]


def test_a_vocabulary_past_the_cap_says_which_min_count_fits():
    # MAX_WORDS + 2 distinct words: 10 seen twice, the rest once
    captions = [f"w{i}" for i in range(MAX_WORDS + 2)] + [f"w{i}" for i in range(10)]
    _raises(lambda: Vocabulary.build(captions), f"{MAX_WORDS + 2:,} words", f"the {MAX_WORDS:,} a vocabulary",
            "raise vocab_min_count (--vocab-min-count) to 2, which keeps 10 words")
    with pytest.warns(UserWarning, match="100% of the training captions' words become <unk>"):
        assert len(Vocabulary.build(captions, min_count=2)) == 4 + 10
    _raises(lambda: Vocabulary.build([f"w{i}" for i in range(50)], max_words=20),
            "nearly every word in them is different")


def test_a_caption_dataset_holds_caption_strings():
    images = torch.zeros(2, 1, 4, 4, dtype=torch.uint8)
    for captions, said in (([["a bag"], [42]], "image b has the caption 42"),
                           ([["a bag"], "a coat"], "image b has captions 'a coat'"),
                           ([["a bag"], []], "image b has no caption"),
                           ([["a bag"], ["  "]], "image b has the caption '  '")):
        _raises(lambda c=captions: CaptionDataset(images, c, "toy", (0.5,), (0.2,), names=["a", "b"]), said,
                error=ValueError)
    ds = CaptionDataset(images, [["a bag"], ["a coat", "a grey coat"]], "toy", (0.5,), (0.2,), names=["a", "b"])
    assert ds.build_vocab().words[4:] == ["a", "coat", "bag", "grey"]

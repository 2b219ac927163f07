"""Caption metrics equal the COCO caption evaluation code's (pycocoevalcap) on fixed cases."""

import math
import random

import pytest
import torch

from vitscope.caption.metrics import (
    attention_grounding,
    caption_words,
    cider_d,
    corpus_bleu,
    peak_cells,
    score_captions,
)
from vitscope.sequence.vocab import BOS, EOS, PAD, Vocabulary


def _coco():
    try:
        from pycocoevalcap.bleu.bleu import Bleu
        from pycocoevalcap.cider.cider import Cider
    except ImportError:
        pytest.skip("pycocoevalcap is not installed (it is a test dependency: "
                    "pip install -c constraints.txt pycocoevalcap==1.2)")
    return Bleu, Cider


def _reference_scores(hyps, refs):
    Bleu, Cider = _coco()
    res = {i: [" ".join(h)] for i, h in enumerate(hyps)}
    gts = {i: [" ".join(r) for r in rs] for i, rs in enumerate(refs)}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    cider, per_image = Cider().compute_score(gts, res)
    return bleu, cider, per_image


CASES = {
    "several references per image": (
        ["a man riding a horse on a beach".split(), "two dogs play in the grass".split(),
         "a plate of food with broccoli".split()],
        [["a man rides a horse along the beach".split(), "a person riding a brown horse on sand".split(),
          "man on a horse at the beach".split()],
         ["two dogs playing on the grass".split(), "a pair of dogs run in a green field".split()],
         ["a plate with broccoli and rice".split(), "food on a white plate".split(),
          "a meal of broccoli and chicken on a plate".split(), "broccoli on a plate".split()]],
    ),
    "no matching 4-grams": (
        ["a cat sits".split(), "dogs".split()],
        [["the cat is sitting on the mat".split(), "a cat on a mat".split()],
         ["two dogs play".split(), "dogs in a park".split()]],
    ),
    "hypothesis longer than every reference, repeated words": (
        ["a a a a bag bag at the top top left".split(), "sneaker sneaker".split()],
        [["a bag at the top left".split(), "top left : bag".split()],
         ["a sneaker".split(), "sneaker".split(), "there is a sneaker in the middle".split()]],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bleu_and_cider_equal_pycocoevalcap(case):
    hyps, refs = CASES[case]
    bleu_ref, cider_ref, per_image_ref = _reference_scores(hyps, refs)
    bleu = corpus_bleu(hyps, refs)
    cider, per_image = cider_d(hyps, refs)
    assert bleu == pytest.approx(bleu_ref, rel=1e-12, abs=1e-15)
    assert cider == pytest.approx(cider_ref, rel=1e-12, abs=1e-15)
    assert per_image == pytest.approx(list(per_image_ref), rel=1e-12, abs=1e-15)


def test_random_corpus_equals_pycocoevalcap():
    rng = random.Random(0)
    words = "a the man dog cat on in sits runs red blue grass bag top left right".split()
    hyps = [[rng.choice(words) for _ in range(rng.randint(1, 12))] for _ in range(30)]
    refs = [[[rng.choice(words) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 5))]
            for _ in range(30)]
    bleu_ref, cider_ref, _ = _reference_scores(hyps, refs)
    assert corpus_bleu(hyps, refs) == pytest.approx(bleu_ref, rel=1e-12)
    assert cider_d(hyps, refs)[0] == pytest.approx(cider_ref, rel=1e-12)


def test_no_4gram_match_is_tiny_not_an_error():
    hyps, refs = CASES["no matching 4-grams"]
    b4 = corpus_bleu(hyps, refs)[3]
    assert 0 < b4 < 1e-3


def test_perfect_caption_scores():
    refs = [["a bag at the top left".split()], ["a coat".split()], ["two sneakers".split()]]
    hyps = [r[0] for r in refs]
    assert corpus_bleu(hyps, refs)[0] == pytest.approx(1.0)
    # CIDEr-D of an exact copy: 10 x the mean over n of cos = 1 where the n-grams exist at all
    _, per_image = cider_d(hyps, refs)
    assert per_image[1] == pytest.approx(10 * 2 / 4)  # 'a coat': 1- and 2-grams only


def test_ids_are_cut_at_eos_and_specials_dropped():
    vocab = Vocabulary.build(["a bag at the top left"])
    ids = [BOS, *vocab.encode("a bag", bos=False, eos=False), EOS, vocab.index["top"], PAD]
    assert caption_words(ids, vocab) == ["a", "bag"]
    scores = score_captions([["a", "bag", "."]], [[["a", "bag"]]])
    assert scores["bleu1"] == pytest.approx(1.0) and set(scores) == {"bleu1", "bleu2", "bleu3", "bleu4", "cider"}


def test_empty_references_are_refused():
    with pytest.raises(ValueError, match="no reference"):
        corpus_bleu([["a"]], [[]])
    with pytest.raises(TypeError, match="word lists"):
        cider_d(["a bag"], [["a bag"]])


def test_peak_cells_follow_patch_centres():
    # a 4 x 4 patch grid over a 2 x 2 cell grid: patch (3, 0) lies in the bottom-left cell (2)
    att = torch.zeros(16)
    att[3 * 4 + 0] = 1
    assert int(peak_cells(att, (4, 4), (56, 56), 2)) == 2
    # 7 x 7 patches over a 2 x 2 grid: the middle patch's centre (28, 28) falls in cell 3
    att = torch.zeros(49)
    att[3 * 7 + 3] = 1
    assert int(peak_cells(att, (7, 7), (56, 56), 2)) == 3


def test_grounding_counts_item_words():
    from vitscope.caption.scenes import Scene

    scene = Scene(cells=2, items=((0, 7), (3, 8)))  # sneaker top left, bag bottom right
    words = "a sneaker at the top left and a bag at the bottom right".split()
    t_sneaker, t_bag = words.index("sneaker"), words.index("bag")
    att = torch.full((len(words), 2, 3, 1 + 16), 0.01)  # (T, L, H, 1 + 4x4 patches), a CLS first
    att[t_sneaker, :, :, 1 + 0] = 1  # patch (0, 0): top left, right
    att[t_bag, 0, :, 1 + 15] = 1  # layer 0 right (bottom right) ...
    att[t_bag, 1, :, 1 + 0] = 1  # ... layer 1 wrong
    g = attention_grounding([words], [att], [scene], grid=(4, 4), image_size=(56, 56), num_prefix_tokens=1)
    assert g.count == 2
    assert g.per_layer.tolist() == [1.0, 0.5]
    assert g.per_head.shape == (2, 3) and torch.all(g.per_head[0] == 1)
    assert not math.isnan(g.mean)

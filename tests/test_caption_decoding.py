"""Greedy and beam search, checked by numbers: a beam as wide as the search space finds the
exhaustive optimum, beam 1 is greedy, the KV cache changes nothing, a batch decodes as its images
one by one, and a beam that never says <eos> ends at max_len."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from test_caption_models import MAX_LEN, images, one_thread, tiny  # noqa: F401 (one_thread: autouse)
from vitscope.caption.decoding import beam_search, decode, greedy
from vitscope.caption.vocab import BOS, EOS, PAD

WORDS = (EOS, 4, 5, 6)  # what can follow <bos>: <unk> is left out of the toy search (see _no_unk)
KINDS = ["transformer", "lstm"]


def _no_unk(model):
    """Make <unk> impossible so the exhaustive search's alphabet is small; beam search bans
    <pad>/<bos> itself."""
    head = model.decoder.head if model.kind == "transformer" else model.head
    with torch.no_grad():
        head.bias[3] = -1e9
    return model


def _all_sequences(max_tokens, no_repeat=0):
    """Every caption of at most max_tokens tokens after <bos>: words then <eos>, or words alone
    when it reaches max_tokens."""
    out = []
    for n in range(1, max_tokens + 1):
        for seq in itertools.product(WORDS[1:], repeat=n):
            out.append(list(seq))
        for seq in itertools.product(WORDS[1:], repeat=n - 1):
            out.append([*seq, EOS])
    out = [s for s in out if len(s) == max_tokens or s[-1] == EOS]
    if no_repeat:
        def repeats(s):
            full = [BOS, *s]
            grams = [tuple(full[i:i + no_repeat]) for i in range(len(full) - no_repeat + 1)]
            return len(grams) != len(set(grams))
        out = [s for s in out if not repeats(s)]
    return out


def _exhaustive(model, x, max_len, length_penalty=0.0, no_repeat=0):
    """Score every possible caption of every image by teacher forcing; return the best per image."""
    seqs = _all_sequences(max_len - 1, no_repeat)
    tokens = torch.full((len(seqs), max_len), PAD)
    tokens[:, 0] = BOS
    for i, s in enumerate(seqs):
        tokens[i, 1:1 + len(s)] = torch.tensor(s)
    best = []
    with torch.no_grad():
        for img in x:
            out = model(img[None].expand(len(seqs), -1, -1, -1), tokens)
            logp = F.log_softmax((out[0] if model.kind == "lstm" else out).float(), -1)
            chosen = logp.gather(2, tokens[:, 1:, None])[..., 0]  # (S, L-1)
            real = tokens[:, 1:] != PAD
            total = (chosen * real).sum(1)
            score = total / real.sum(1).float() ** length_penalty
            i = int(score.argmax())
            best.append((tokens[i], float(score[i]), float(total[i])))
    return best


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length_penalty,no_repeat", [(0.0, 0), (1.0, 0), (0.6, 2)])
def test_full_width_beam_equals_exhaustive_search(kind, length_penalty, no_repeat):
    model, x = _no_unk(tiny(kind)), images(2)
    max_len = 5  # 4 tokens after <bos>: 3^4 live + 40 ended captions, so a beam of 128 holds all
    want = _exhaustive(model, x, max_len, length_penalty, no_repeat)
    got = beam_search(model, x, beam=128, max_len=max_len, length_penalty=length_penalty,
                      no_repeat_ngram_size=no_repeat)
    for i, (tokens, score, total) in enumerate(want):
        assert got.tokens[i].tolist() == tokens.tolist()
        assert float(got.score[i]) == pytest.approx(score, rel=1e-5)
        assert float(got.log_prob[i]) == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_beam_one_is_greedy(kind):
    model, x = tiny(kind), images(4)
    g = greedy(model, x)
    b = beam_search(model, x, beam=1)
    assert torch.equal(b.tokens, g.tokens)
    torch.testing.assert_close(b.log_prob, g.log_prob)
    torch.testing.assert_close(b.attention, g.attention)
    assert torch.equal(decode(model, x, beam=1).tokens, g.tokens)


def test_beam_with_cache_equals_beam_without():
    model, x = tiny("transformer"), images(3)
    for kw in (dict(beam=4), dict(beam=3, length_penalty=1.0, no_repeat_ngram_size=2)):
        a = beam_search(model, x, use_cache=True, **kw)
        b = beam_search(model, x, use_cache=False, **kw)
        assert torch.equal(a.beam_tokens, b.beam_tokens)
        torch.testing.assert_close(a.beam_scores, b.beam_scores, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.attention, b.attention, rtol=1e-5, atol=1e-6)
    assert torch.equal(greedy(model, x, use_cache=True).tokens, greedy(model, x, use_cache=False).tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_decodes_as_its_images_one_by_one(kind):
    model, x = tiny(kind), images(3)
    together = beam_search(model, x, beam=3, length_penalty=0.7)
    for i in range(3):
        alone = beam_search(model, x[i:i + 1], beam=3, length_penalty=0.7)
        n = alone.tokens.shape[1]
        assert together.tokens[i, :n].tolist() == alone.tokens[0].tolist()
        assert torch.all(together.tokens[i, n:] == PAD)
        torch.testing.assert_close(together.score[i], alone.score[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_of_each_chosen_word(kind):
    model, x = tiny(kind), images(2)
    out = beam_search(model, x, beam=3)
    length = out.tokens.shape[1] - 1
    n_tokens = 5  # class token + 2 x 2 patches
    assert out.attention.shape == ((2, length, 2, 2, n_tokens) if kind == "transformer" else (2, length, n_tokens))
    for i in range(2):
        real = int(out.lengths[i])
        sums = out.attention[i].sum(-1)
        torch.testing.assert_close(sums[:real], torch.ones_like(sums[:real]))  # softmax rows
        assert torch.all(out.attention[i, real:] == 0)  # nothing after the caption ends


@pytest.mark.parametrize("kind", KINDS)
def test_beams_that_never_end_stop_at_max_len(kind):
    model, x = tiny(kind), images(2)
    head = model.decoder.head if kind == "transformer" else model.head
    with torch.no_grad():
        head.bias[EOS] = -1e9  # <eos> is never chosen
    for out in (beam_search(model, x, beam=4, length_penalty=1.0), greedy(model, x)):
        assert out.tokens.shape == (2, MAX_LEN) and torch.all(out.tokens[:, 1:] != EOS)
        assert out.lengths.tolist() == [MAX_LEN - 1] * 2 and torch.all(torch.isfinite(out.score))


@pytest.mark.parametrize("kind", KINDS)
def test_no_repeat_ngrams(kind):
    model, x = tiny(kind), images(3)
    out = beam_search(model, x, beam=3, no_repeat_ngram_size=1)
    for row in out.tokens.tolist():
        words = [t for t in row if t not in (BOS, EOS, PAD)]
        assert len(words) == len(set(words))


def test_bad_arguments_are_clear_errors():
    model, x = tiny("transformer"), images(1)
    with pytest.raises(ValueError, match="beam size must be at least 1"):
        beam_search(model, x, beam=0)
    with pytest.raises(ValueError, match="beam size must be at least 1"):
        decode(model, x, beam=0)
    with pytest.raises(ValueError, match=r"max_len=7 exceeds the decoder's 6 positions"):
        greedy(model, x, max_len=7)
    with pytest.raises(ValueError, match="images .* or an encoded memory"):
        greedy(model)

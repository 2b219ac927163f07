"""Greedy and beam search, checked by numbers: a beam as wide as the search space finds the
exhaustive optimum, beam 1 is greedy, the KV cache changes nothing, a batch decodes as its images
one by one, and a beam that never says <eos> ends at max_len."""

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from test_caption_models import MAX_LEN, images, one_thread, tiny  # noqa: F401 (one_thread: autouse)
from vitscope.errors import ConfigError
from vitscope.sequence.decoding import beam_search, decode, greedy
from vitscope.sequence.vocab import BOS, EOS, PAD

WORDS = (EOS, 4, 5, 6)  # what can follow <bos>: <unk> is left out of the toy search (see _no_unk)
KINDS = ["transformer", "lstm"]


def _no_unk(model):
    """Make <unk> impossible so the exhaustive search's alphabet is small; beam search bans
    <pad>/<bos> itself."""
    head = model.decoder.head if model.kind == "transformer" else model.head
    with torch.no_grad():
        head.bias[3] = -1e9
    return model


def _real(tokens):
    """A caption's tokens without its trailing pads."""
    return [t for t in tokens.tolist() if t != PAD]


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
        assert _real(got.tokens[i]) == _real(tokens)
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


# -- the standard beam search against a plain one, on tables of next-token probabilities ------------------
class TableModel:
    """A step model with no network: table[b, t, prev] (B, max_len - 1, V, V) is image b's next-token
    distribution after token `prev` at step t. Its "attention" is that distribution, so a hypothesis's
    traced attention can be checked against the table."""

    def __init__(self, table):
        self.table, self.max_len = table, table.shape[1] + 1

    def encode(self, images):
        return images

    def start(self, memory, memory_padding=None, *, use_cache=True, bos=BOS, beams=1):
        rows = memory[:, 0].long().repeat_interleave(beams)  # the memory of image b is [b]
        return SimpleNamespace(image=rows, tokens=torch.full((len(rows), 1), bos))

    def step(self, state):
        probs = self.table[state.image, state.tokens.shape[1] - 1, state.tokens[:, -1]]  # (R, V)
        return probs.log(), probs, state

    def reorder(self, state, index):
        assert torch.equal(state.image[index], state.image)  # beams stay with their image
        return SimpleNamespace(image=state.image, tokens=state.tokens[index])

    def extend(self, state, token):
        return SimpleNamespace(image=state.image, tokens=torch.cat([state.tokens, token[:, None]], 1))


def plain_beam_search(next_log_probs, k, max_len, length_penalty):
    """The standard search for one image, written for reading: each step ranks every live hypothesis's
    continuations, takes the 2K best; an <eos> among the K best finishes (scored with the length penalty),
    the K best others stay live; stop when K have finished and no live hypothesis can beat the worst of
    them at any length still open to it, or at max_len, where the live ones finish. Returns the finished
    (score, log_prob, tokens), best first."""
    live, finished = [([BOS], 0.0)], []
    for length in range(1, max_len):
        candidates = []
        for tokens, total in live:
            for word, lp in enumerate(next_log_probs(tokens)):
                if word not in (PAD, BOS) and lp > float("-inf"):
                    candidates.append((total + lp, tokens + [word]))
        candidates.sort(key=lambda c: -c[0])
        live = []
        for rank, (total, tokens) in enumerate(candidates[:2 * k]):
            if tokens[-1] == EOS:
                if rank < k:
                    finished.append((total / length ** length_penalty, total, tokens))
            elif len(live) < k:
                live.append((tokens, total))
        if length == max_len - 1:
            finished += [(total / length ** length_penalty, total, tokens) for tokens, total in live]
        finished = sorted(finished, key=lambda f: -f[0])[:k]
        if length == max_len - 1 or not live:
            break
        best_live = max(total for _, total in live)
        open_lengths = range(length + 1, max_len)
        can_reach = max(best_live / n ** length_penalty for n in open_lengths)
        if len(finished) == k and finished[-1][0] >= can_reach:
            break
    return finished


def _table_next(table, b):
    def next_log_probs(tokens):
        return table[b, len(tokens) - 1, tokens[-1]].double().log().tolist()
    return next_log_probs


def test_a_finished_caption_passed_by_live_beams_that_then_fall_is_kept():
    """Beam 2. After <bos>: "a" 0.65, <eos> 0.30. After "a": "c" or "d", 0.5 each, so both live beams
    (log 0.325 each) pass the finished <eos> (log 0.30); every word after them costs log 0.5 more, below
    it. Kept in a live slot by raw log-probability, the finished caption would be pushed out at step 2."""
    a, b_, c, d = 4, 5, 6, 7
    v, max_len = 8, 5
    table = torch.full((1, max_len - 1, v, v), 0.0)
    table[0, 0, BOS, [a, EOS, b_]] = torch.tensor([0.65, 0.30, 0.05])
    table[0, 1, a, [c, d]] = 0.5
    table[0, 1, b_, EOS] = 1.0
    for t in (2, 3):
        table[0, t, [c, d, a], EOS] = 0.5
        table[0, t, [c, d, a], a] = 0.5
    out = beam_search(TableModel(table), memory=torch.zeros(1, 1), beam=2, max_len=max_len)
    assert out.tokens[0].tolist() == [BOS, EOS]
    assert float(out.log_prob[0]) == pytest.approx(float(torch.tensor(0.30).log()))
    assert out.lengths.tolist() == [1]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 0.6, -0.5])
@pytest.mark.parametrize("seed", range(4))
def test_beam_search_equals_the_plain_standard_search_on_random_tables(seed, length_penalty):
    g = torch.Generator().manual_seed(seed)
    b, v, max_len, k = 4, 9, 7, 3
    logits = torch.randn(b, max_len - 1, v, v, generator=g) * 2
    logits[..., EOS] -= 1.5  # captions of many lengths, not all of one
    logits[..., [PAD, BOS]] = float("-inf")
    table = logits.softmax(-1)
    out = beam_search(TableModel(table), memory=torch.arange(float(b))[:, None], beam=k, max_len=max_len,
                      length_penalty=length_penalty)
    for i in range(b):
        want = plain_beam_search(_table_next(table, i), k, max_len, length_penalty)
        assert _real(out.tokens[i]) == want[0][2]
        assert float(out.score[i]) == pytest.approx(want[0][0], rel=1e-5)
        assert float(out.log_prob[i]) == pytest.approx(want[0][1], rel=1e-5)
        assert [_real(t) for t in out.beam_tokens[i]] == [w[2] for w in want]
        torch.testing.assert_close(out.beam_scores[i].double(), torch.tensor([w[0] for w in want], dtype=torch.double),
                                   rtol=1e-5, atol=1e-5)
        for j, (_, _, tokens) in enumerate(want):  # every hypothesis keeps the attention of its own words
            steps = len(tokens) - 1
            expect = torch.stack([table[i, t, tokens[t]] for t in range(steps)])
            torch.testing.assert_close(out.beam_attention[i, j, :steps], expect)
            assert torch.all(out.beam_attention[i, j, steps:] == 0)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_beam_search_on_captioners_equals_the_plain_search_on_teacher_forced_prefixes(kind, padded):
    """The captioners' beams share one memory row per image (and the transformer its cross-attention
    keys/values, the LSTM its keys and mask); the plain search reruns each prefix alone, its own image row
    each."""
    model, x = tiny(kind), images(3)
    padding = None
    if padded:  # image tokens left out per image, as a dataset of differently sized images gives
        padding = torch.zeros(3, 5, dtype=torch.bool)
        padding[0, 3:] = True
        padding[2, 1] = True
    k, lp = 3, 0.7
    memory = model.encode(x).detach()
    out = beam_search(model, memory=memory, memory_padding=padding, beam=k, length_penalty=lp)
    plain = beam_search(model, memory=memory, memory_padding=padding, beam=k, length_penalty=lp, use_cache=False)
    assert torch.equal(out.beam_tokens, plain.beam_tokens)
    for i in range(3):
        pad = None if padding is None else padding[i:i + 1]

        def next_log_probs(tokens, mem=memory[i:i + 1], pad=pad):
            with torch.no_grad():
                out = model.teacher_forced(mem, torch.tensor([tokens + [PAD]]), memory_padding=pad)
                logits = (out[0] if kind == "lstm" else out)[0, -1].float()
            return F.log_softmax(logits, -1).tolist()
        want = plain_beam_search(next_log_probs, k, MAX_LEN, lp)
        assert [_real(t) for t in out.beam_tokens[i]] == [w[2] for w in want]
        torch.testing.assert_close(out.beam_scores[i].double(), torch.tensor([w[0] for w in want], dtype=torch.double),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_length_penalty_that_is_not_a_number_is_refused(bad):
    model, x = tiny("transformer"), images(1)
    for search in (greedy, beam_search, decode):
        with pytest.raises(ConfigError, match=f"length penalty {bad} is not a finite number"):
            search(model, x, length_penalty=bad)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_follows_the_teacher_forced_argmax_and_stops_at_eos(kind):
    model, x = tiny(kind), images(4)
    out = greedy(model, x)
    with torch.no_grad():
        logits = model(x, torch.cat([out.tokens, torch.full((4, 1), PAD)], 1))
        logp = F.log_softmax((logits[0] if kind == "lstm" else logits).float(), -1)
    logp[..., [PAD, BOS]] = float("-inf")  # never generated
    for i in range(4):
        n = int(out.lengths[i])
        assert torch.equal(logp[i, :n].argmax(-1), out.tokens[i, 1:n + 1])
        assert out.tokens[i, n] == EOS or n == MAX_LEN - 1
        assert torch.all(out.tokens[i, n + 1:] == PAD)
        total = logp[i, :n].gather(1, out.tokens[i, 1:n + 1, None]).sum()
        assert float(out.log_prob[i]) == pytest.approx(float(total), rel=1e-5)

"""The translators: the additive-attention decoder's weights are a distribution over the real source words
(pads get none), teacher-forced logits equal step-by-step decoding, beam search never returns a translation
worse than greedy's, and a short training learns the pair's reordering."""

from __future__ import annotations

import pytest
import torch

from vitscope.sequence.decoding import beam_search, greedy
from vitscope.sequence.loss import trim_padding
from vitscope.sequence.vocab import PAD
from vitscope.translate.builders import ParallelData, build_translator
from vitscope.translate.evaluate import evaluate_translations
from vitscope.translate.language import make_pair


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data():
    return ParallelData.build(make_pair(0, train_size=600, test_size=40, max_words=12))


def small(kind: str, data, **kw):
    torch.manual_seed(0)
    sizes = (dict(embed_dim=16, hidden_dim=16, attn_dim=16) if kind == "rnn"
             else dict(dim=16, depth=2, num_heads=2, mlp_ratio=1.0))
    return build_translator(kind, data, {**sizes, "drop": 0.0, **kw}).eval()


def test_additive_attention_sums_to_one_over_the_real_words_and_leaves_pads_at_zero(data):
    model = small("rnn", data)
    src, tgt = trim_padding(data.test.src[:8]), trim_padding(data.test.tgt[:8])
    _, alphas = model(src, tgt)  # (B, T-1, N)
    pads = src == PAD
    assert pads.any()  # the batch has sentences of different lengths
    assert (alphas.masked_select(pads[:, None].expand_as(alphas)) == 0).all()
    real_steps = tgt[:, 1:] != PAD
    sums = alphas.sum(-1)[real_steps]
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)


def test_the_rnn_without_attention_reads_the_same_context_at_every_word(data):
    model = small("rnn", data, attention=False)
    src = data.test.src[:4]
    memory = model.encode(src)
    state = model.start(memory, src == PAD)
    context = state.context.clone()
    for _ in range(3):
        _, alpha, state = model.step(state)
        state = model.extend(state, torch.full((4,), 5))
        assert torch.equal(state.context, context)
        assert (alpha == 0).all()


@pytest.mark.parametrize("kind", ["rnn", "transformer"])
def test_teacher_forced_logits_equal_step_by_step_decoding(kind, data):
    model = small(kind, data)
    src, tgt = trim_padding(data.test.src[:5]), trim_padding(data.test.tgt[:5])
    logits = model(src, tgt)[0] if kind == "rnn" else model(src, tgt)
    state = model.start(model.encode(src), src == PAD)
    for t in range(tgt.shape[1] - 1):
        step_logits, _, state = model.step(state)
        real = tgt[:, t + 1] != PAD
        assert torch.allclose(step_logits[real], logits[real, t], atol=1e-5)
        state = model.extend(state, tgt[:, t + 1])


@pytest.mark.parametrize("kind", ["rnn", "transformer"])
def test_beam_search_is_never_worse_than_greedy(kind, data):
    model = small(kind, data)
    src = data.test.src[:6]
    memory, pads = model.encode(src), src == PAD
    g = greedy(model, memory=memory, memory_padding=pads, max_len=16)
    b = beam_search(model, memory=memory, memory_padding=pads, beam=4, max_len=16)
    assert (b.score >= g.score - 1e-5).all()
    # the attention of each word of the best hypothesis is over the source words only
    n = (~pads).sum(1)
    att = b.attention if kind == "rnn" else b.attention.mean((2, 3))
    for i in range(len(src)):
        words = int(b.lengths[i])
        assert torch.allclose(att[i, :words, : n[i]].sum(-1), torch.ones(words), atol=1e-5)


@pytest.mark.slow
def test_a_short_training_learns_the_reordering(data):
    """About 15 seconds on one quiet core (28 on a shared one): the RNN with attention gets most test sentences
    right and its attention peaks on the gold source word for most target words, with no alignment given."""
    torch.manual_seed(0)
    model = build_translator("rnn", data, dict(embed_dim=48, hidden_dim=48, attn_dim=48, drop=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(260):
        idx = torch.randint(0, len(data.train), (32,), generator=gen)
        src, tgt = trim_padding(data.train.src[idx]), trim_padding(data.train.tgt[idx])
        loss = model.losses(src, tgt)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    m = evaluate_translations(model, data.test, data.tgt_vocab, beam=3).metrics
    assert m["exact_match"] > 0.5
    assert m["alignment"] > 0.7


def test_the_heatmap_is_a_figure_with_the_words_on_its_axes(tmp_path):
    from matplotlib.figure import Figure

    from vitscope.translate.plots import alignment_figure

    source, target = ["the", "dog", "small"], ["lo", "pik", "tolu"]
    att = torch.tensor([[0.9, 0.05, 0.05], [0.1, 0.1, 0.8], [0.2, 0.7, 0.1]])
    fig = alignment_figure(source, target, att, gold=[0, 2, 1], path=tmp_path / "a.png")
    assert isinstance(fig, Figure) and (tmp_path / "a.png").stat().st_size > 1000
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == source
    assert [t.get_text() for t in ax.get_yticklabels()] == target
    assert [p.get_edgecolor()[:3] for p in ax.patches] == [(0.0, 229 / 255, 1.0)] * 3  # every peak on its gold word

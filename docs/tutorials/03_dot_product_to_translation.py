# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 3. From dot products to translation
#
# Attention is older than the transformer. It was invented for **translation** (Bahdanau, Cho and
# Bengio, 2014): an RNN decoder writing a sentence in one language looked back, at every word, over
# the encoder's states of the sentence in the other, and the weights it learned turned out to be a
# word **alignment**, found with no alignment ever given.
#
# This tutorial builds attention up in the order the ideas came, each step checked with an `assert`:
# parameter-free attention softmax(X Xᵀ) X; learned queries, keys and values; several heads; the
# causal and padding masks; attention from one sequence to another (encoder–decoder attention); and
# Bahdanau's additive attention. Then it trains vitscope's RNN translator on a small synthetic
# language pair whose word order differs from the source's by rule, and shows the alignment heatmap
# the attention learned.
#
# It runs in about a minute on 2 CPU cores.

# %%
# %matplotlib inline
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from IPython.display import display

import vitscope
from vitscope.attention import AdditiveAttention, causal_mask
from vitscope.training.config import TrainConfig
from vitscope.training.loop import train
from vitscope.translate import alignment_figure, make_pair, open_translator

torch.manual_seed(0)
torch.set_num_threads(min(2, torch.get_num_threads()))
torch.set_printoptions(precision=3, sci_mode=False)

# %% [markdown]
# ## Parameter-free attention: softmax(X Xᵀ) X
#
# Take N token vectors X (N, D). Each token compares itself with every token by a dot product, the
# softmax turns each row of scores into weights that sum to 1, and each output is the weighted mean
# of the tokens. Nothing is learned.

# %%
x = torch.randn(5, 8)
weights = (x @ x.T).softmax(dim=-1)  # (N, N), row i: how much token i takes from each token
out = weights @ x                    # (N, D)
ours, ours_weights = vitscope.dot_product_attention(x, return_weights=True)
assert torch.allclose(ours, out, atol=1e-5) and torch.allclose(ours_weights, weights, atol=1e-5)
assert torch.allclose(weights.sum(-1), torch.ones(5), atol=1e-5)
print(weights)

# %% [markdown]
# Every token looks mostly at itself (x·x is the largest dot product a vector of its length can
# have with vectors no longer than it), and the weights are fixed by the data: there is nothing to
# train. That is what the next step changes.
#
# ## Queries, keys and values
#
# Three learned projections give each token a **query** (what it looks for), a **key** (what it
# offers to be found by) and a **value** (what it hands over). Scores are query·key / √D, the scale
# keeping the softmax from saturating as D grows (tutorial 1 measures why).

# %%
dim = 16
to_q, to_k, to_v = (torch.nn.Linear(dim, dim) for _ in range(3))
x = torch.randn(2, 6, dim)  # (B, N, dim)
with torch.no_grad():
    q, k, v = to_q(x), to_k(x), to_v(x)
    scores = q @ k.transpose(-2, -1) / dim**0.5  # (B, N, N)
    by_hand = scores.softmax(-1) @ v
    # vitscope.attend takes heads: (B, H, N, D), here one head
    fused = vitscope.attend(q[:, None], k[:, None], v[:, None])[:, 0]
assert torch.allclose(fused, by_hand, atol=1e-5)
assert torch.allclose(fused, F.scaled_dot_product_attention(q, k, v), atol=1e-5)

# %% [markdown]
# ## Several heads
#
# Multi-head attention runs H such attentions side by side on slices of width D = dim / H and mixes
# their outputs with one projection, so different heads can look for different things.
# `vitscope.MultiHeadAttention` keeps timm's names (one fused `qkv` projection, then `proj`); with the
# same weights it equals `torch.nn.MultiheadAttention`.

# %%
heads = 4
mha = vitscope.MultiHeadAttention(dim, num_heads=heads).eval()
torch_mha = torch.nn.MultiheadAttention(dim, heads, batch_first=True).eval()
with torch.no_grad():
    torch_mha.in_proj_weight.copy_(mha.qkv.weight)
    torch_mha.in_proj_bias.copy_(mha.qkv.bias)
    torch_mha.out_proj.weight.copy_(mha.proj.weight)
    torch_mha.out_proj.bias.copy_(mha.proj.bias)
    ours, ours_weights = mha(x, return_weights=True)
    theirs, their_weights = torch_mha(x, x, x, average_attn_weights=False)
print("largest difference:", (ours - theirs).abs().max().item())
assert torch.allclose(ours, theirs, atol=1e-5) and torch.allclose(ours_weights, their_weights, atol=1e-5)

# by hand, in einops: split the fused projection into heads, attend per head, put them side by side
with torch.no_grad():
    q, k, v = rearrange(mha.qkv(x), "b n (three h d) -> three b h n d", three=3, h=heads)
    w = (einsum(q, k, "b h i d, b h j d -> b h i j") / (dim // heads) ** 0.5).softmax(-1)
    by_hand = mha.proj(rearrange(w @ v, "b h n d -> b n (h d)"))
assert torch.allclose(by_hand, ours, atol=1e-5)

# %% [markdown]
# ## Masks: no looking ahead, no looking at padding
#
# A boolean mask is **True where a query may look** (the convention of
# `F.scaled_dot_product_attention`). The **causal** mask lets token i see tokens 0..i only, so a
# decoder cannot read the word it must predict; the **padding** mask hides the filler after short
# sequences in a batch. A masked key gets weight exactly 0.

# %%
lengths = torch.tensor([6, 4])
padding = vitscope.key_padding_mask(lengths)  # (B, 1, 1, N), True at real tokens
with torch.no_grad():
    _, w_causal = mha(x, causal=True, return_weights=True)
    _, w_pad = mha(x, mask=padding, return_weights=True)
print(causal_mask(6, 6).int())
assert (w_causal.masked_select(~causal_mask(6, 6)) == 0).all()
assert (w_pad[1, :, :, 4:] == 0).all()  # the second sentence's two pads are never looked at
assert torch.allclose(w_pad.sum(-1), torch.ones(2, heads, 6), atol=1e-5)

# %% [markdown]
# ## Encoder–decoder attention
#
# In a translator the decoder's words ask the questions and the source sentence answers: queries
# come from one sequence, keys and values from another (**cross-attention**). vitscope's module takes
# `cross=True` and a `context`; it projects the queries with `q` and the keys and values with one
# `kv`. It equals PyTorch's module given the same weights.

# %%
cross = vitscope.MultiHeadAttention(dim, num_heads=heads, cross=True).eval()
source = torch.randn(2, 9, dim)   # the encoder's states, 9 source words
target = torch.randn(2, 5, dim)   # the decoder's states, 5 target words
with torch.no_grad():
    torch_mha.in_proj_weight.copy_(torch.cat([cross.q.weight, cross.kv.weight]))
    torch_mha.in_proj_bias.copy_(torch.cat([cross.q.bias, cross.kv.bias]))
    torch_mha.out_proj.weight.copy_(cross.proj.weight)
    torch_mha.out_proj.bias.copy_(cross.proj.bias)
    ours, w_cross = cross(target, source, return_weights=True)
    theirs, _ = torch_mha(target, source, source)
assert torch.allclose(ours, theirs, atol=1e-5)
print("cross-attention weights per target word, over the source words:", tuple(w_cross.shape))

# %% [markdown]
# ## Additive attention: Bahdanau's score
#
# The first attention in translation did not take a dot product: a small MLP scored each pair,
# score(s, h) = vᵀ tanh(W_s s + W_h h), where s is the decoder's state and h an encoder state.
# `vitscope.attention.AdditiveAttention` is that score, a softmax over the source words (pads
# masked) and the weighted sum, the **context vector**.

# %%
additive = AdditiveAttention(query_dim=dim, key_dim=dim, hidden_dim=32)
state = torch.randn(2, dim)                       # one decoder state per sentence
keep = torch.arange(9)[None] < torch.tensor([[9], [6]])  # (B, N) True at real source words
with torch.no_grad():
    context, alpha = additive(state, source, mask=keep)
    scores = additive.score(torch.tanh(additive.query_proj(state)[:, None] + additive.key_proj(source)))[..., 0]
    by_hand = scores.masked_fill(~keep, float("-inf")).softmax(-1)
assert torch.allclose(alpha, by_hand, atol=1e-5)
assert torch.allclose(context, (alpha[..., None] * source).sum(1), atol=1e-5)
assert (alpha[1, 6:] == 0).all() and torch.allclose(alpha.sum(-1), torch.ones(2), atol=1e-5)

# %% [markdown]
# ## A language pair with known alignments
#
# `vitscope.translate.make_pair` draws sentences of a small synthetic language pair from a seed. The
# source puts adjectives after the noun and the verb in the middle; the target is verb-final with
# its adjectives before the noun in mirror order, and a few words become two. Every target word
# records the source word it translates, so we can later check where the attention looked. Train
# and test sentences never overlap.

# %%
pair = make_pair(seed=0, train_size=4000, test_size=300, max_words=12)
example = max(pair.test[:50], key=lambda e: len(e.source))
print("source:", " ".join(example.source))
print("target:", " ".join(example.target))
print("gold:  ", example.alignment)
assert not {e.source for e in pair.train} & {e.source for e in pair.test}

# %% [markdown]
# ## Training the RNN with attention
#
# The translator is a bidirectional GRU over the source words and a GRU decoder that, at every word
# it writes, scores every encoder state with additive attention and reads their weighted sum
# (`vitscope.translate.RNNTranslator`). It trains on the same loop as vitscope's classifiers and
# captioners (`vitscope train --task translate` on the command line). Small settings here: 4,000
# sentences of up to 12 words, three passes; the full preset (`translate_rnn`) is in the user guide.

# %%
run_dir = Path(tempfile.mkdtemp()) / "translate"
cfg = TrainConfig(task="translate", dataset="synthetic_pair", translator="rnn", train_sentences=4000,
                  test_sentences=300, max_words=12, epochs=3, batch_size=32, lr=3e-3, min_lr=1e-4,
                  weight_decay=0.0, warmup_epochs=0.1, label_smoothing=0.0, amp="fp32", kernels=False,
                  explain_images=4, decoder_args={"embed_dim": 64, "hidden_dim": 64, "attn_dim": 64, "drop": 0.0})
result = train(cfg, run_dir, progress=False)
print(result.describe(), f"after {result.train_time_s:.0f} s of training")

# %% [markdown]
# ## Did it learn the alignment?
#
# `vitscope eval` reads the attention teacher-forced on the reference translation, so every target
# word has a gold source word; **alignment accuracy** is the share whose attention peaks on it.

# %%
from vitscope.translate import ParallelData, evaluate_translations  # noqa: E402

translator = open_translator(run_dir)
data = ParallelData.build(make_pair(seed=0, train_size=4000, test_size=300, max_words=12))
metrics = evaluate_translations(translator.model, data.test, data.tgt_vocab, beam=3).metrics
print(f"exact sentences {100 * metrics['exact_match']:.1f}%, tokens {100 * metrics['token_accuracy']:.1f}%, "
      f"BLEU-4 {metrics['bleu4']:.3f}, alignment {100 * metrics['alignment']:.1f}%")
assert metrics["exact_match"] > 0.8
assert metrics["alignment"] > 0.85

# %% [markdown]
# The heatmap: source words along the top, the target words it wrote down the side, each row one
# word's attention. The boxes are the gold alignment (cyan where the peak is on it). The reordering
# is visible: the verb is written last but looked up in the middle, the adjectives come before
# their noun and in mirror order, and both words of a two-word verb look at the same source word.

# %%
from vitscope.translate.run import teacher_forced_attention  # noqa: E402

i = data.test.examples.index(example)
attention = teacher_forced_attention(translator.model, data, i)  # (T, N)
fig = alignment_figure(example.source, example.target, attention, gold=example.alignment,
                       title="RNN with additive attention: where each target word looked")
display(fig)
peaks = attention.argmax(-1).tolist()
print("peaks:", peaks)
assert sum(p == g for p, g in zip(peaks, example.alignment)) >= 0.8 * len(peaks)

# %% [markdown]
# The translation explorer shows the same for several sentences at once: pick a sentence, read its
# translation (beam search here), click one of its words and see where it looked, a bar over each
# source word with the gold one underlined, and the whole sentence's heatmap below. In a notebook it
# shows inline; `.save("translations.html")` writes the same page to a file.

# %%
import json  # noqa: E402

from vitscope.inspect.translate_explorer import translate_explorer_data, translate_page  # noqa: E402

shown = data.test.examples[:8]
translations = translator.translate([e.source for e in shown], beam=3)
page = translate_page(translate_explorer_data(
    [t.source for t in translations], [t.words for t in translations], [t.attention for t in translations],
    gold=[e.alignment for e in shown], references=[e.target for e in shown]))
for e, t in zip(shown, translations):  # every sentence, its translation and its reference travel in the page
    for words in (e.source, t.words, e.target):
        assert json.dumps(list(words), separators=(",", ":")) in page.html
assert page._repr_html_().startswith("<iframe")
display(page)

# %% [markdown]
# The run also wrote `alignment.png` and `translations.html`, the same explorer over its first test
# sentences:

# %%
print(sorted(p.name for p in run_dir.iterdir() if p.suffix in (".png", ".html", ".json")))
assert (run_dir / "alignment.png").is_file() and (run_dir / "translations.html").is_file()

# %% [markdown]
# ## What we checked
#
# - Parameter-free attention softmax(X Xᵀ) X, scaled dot-product attention with queries, keys and
#   values, multi-head attention and cross-attention give PyTorch's results to 1e-5.
# - Masked keys, causal or padding, get weight exactly 0, and every row still sums to 1.
# - Bahdanau's additive attention is an MLP score, a masked softmax and a weighted sum.
# - An RNN translator trained for about a minute translates most unseen sentences word for word,
#   and its attention, never told where to look, peaks on the source word each target word
#   translates: the alignment the 2014 paper found.
#
# Full runs, the transformer's heads and the bottleneck of the RNN without attention:
# the [translate guide](../guide/translate.md) and `benchmarks/RESULTS.md`.

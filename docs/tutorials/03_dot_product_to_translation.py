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
# Attention is older than the transformer. The soft attention transformers use, a softmax over every
# position of a sequence (another one, or its own) scored by content, came to neural networks through
# **translation**. Bahdanau, Cho and Bengio (2014) let an RNN decoder, at every word it wrote, look back
# over the encoder's states of the source sentence with a small learned scoring network (additive
# attention); plotted, the weights it learned looked like a word **alignment**, though no alignment was
# ever given. Luong, Pham and Manning (2015) compared several scores (dot, general, concat), the plain dot
# product among them; Vaswani et al. (2017) scaled the dot product by 1/√d, projected queries, keys and
# values from the sequences themselves, ran several heads side by side, masked, and dropped the RNN.
#
# This tutorial walks that history backwards, from the simplest form back to where translation
# began, each step checked against vitscope and PyTorch: parameter-free attention softmax(X Xᵀ) X;
# learned queries, keys and values; several heads; the causal and padding masks; attention from one
# sequence to another (encoder–decoder attention); and Bahdanau's additive score. Then it trains
# vitscope's RNN translator on a small synthetic language pair whose word order differs from the
# source's by rule, shows the alignment its attention learned, and trains the same RNN without
# attention beside it, to show what attention fixed: one vector for the whole sentence, which loses
# the long sentences.
#
# As recorded on our machine (yours will differ), it ran in 1.5 to 4 minutes (executed as the tests
# execute it, in a Jupyter kernel) on 2 cores of an AMD EPYC (Zen 3, AVX2) shared with other jobs, most of
# it the two trainings; the last cell prints how long your run took.

# %%
# %matplotlib inline
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from IPython.display import Markdown, display

import vitscope
from vitscope.attention import AdditiveAttention, causal_mask
from vitscope.training.config import TrainConfig
from vitscope.training.loop import train
from vitscope.training.options import TranslateOptions
from vitscope.translate import (
    ParallelData,
    accuracy_by_length_figure,
    alignment_figure,
    evaluate_translations,
    make_pair,
    open_translator,
)
from vitscope.translate.run import teacher_forced_attention

started = time.perf_counter()
torch.manual_seed(0)
torch.set_num_threads(1)  # as the translation presets are trained: the GRU's matrices are small
torch.set_printoptions(precision=3, sci_mode=False)

# %% [markdown]
# ## Parameter-free attention: softmax(X Xᵀ) X
#
# Take N token vectors X (N, D). Each token compares itself with every token by a dot product, the
# softmax turns each row of scores into weights that sum to 1, and each output is the weighted mean
# of the tokens. Nothing is learned. We make the tokens unit vectors, as tutorial 1 does.

# %%
x = F.normalize(torch.randn(5, 8), dim=-1)  # 5 tokens of width 8, unit length
weights = (x @ x.T).softmax(dim=-1)  # (N, N), row i: how much token i takes from each token
out = weights @ x                    # (N, D)
ours, ours_weights = vitscope.dot_product_attention(x, return_weights=True)
assert torch.allclose(ours, out, atol=1e-5) and torch.allclose(ours_weights, weights, atol=1e-5)
assert torch.allclose(F.scaled_dot_product_attention(x, x, x, scale=1.0), out, atol=1e-5)  # PyTorch's, unscaled
print(weights)
print("each token's weight on itself:", weights.diagonal())

# %% [markdown]
# For unit vectors a token's weight on itself is the largest in its row (x·y ≤ |x||y| = x·x), but
# it is not most of the row: the rows above give the rest to the other tokens. Tutorial 1 measures
# that the own weight is about e / (e + N − 1) for random unit vectors, less the longer the
# sequence, and that without the unit length even the first claim fails: a longer token can
# outscore a token's own dot product. Either way the weights are fixed by the data: there is
# nothing to train. That is what the next step changes.
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
# decoder cannot read the word it must predict. It belongs to self-attention: an RNN decoder reads
# its words in order and never sees the future, but self-attention sees every position at once, so
# the transformer's decoder masks what comes later. The **padding** mask hides the filler after
# short sequences in a batch; any attention over a batch of sentences of different lengths needs
# it, the additive attention below included. A masked key gets weight exactly 0.

# %%
lengths = torch.tensor([6, 4])
padding = vitscope.key_padding_mask(lengths)  # (B, 1, 1, N), True at real tokens
with torch.no_grad():
    _, w_causal = mha(x, causal=True, return_weights=True)
    _, w_pad = mha(x, mask=padding, return_weights=True)
print(causal_mask(6, 6).int())
assert (w_causal.masked_select(~causal_mask(6, 6)) == 0).all()
assert (w_pad[1, :, :, 4:] == 0).all()  # the second sentence's two pads are never looked at

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
# Bahdanau et al.'s attention did not take a dot product: a small MLP scored each pair,
# score(s, h) = vᵀ tanh(W_s s + W_h h), where s is the decoder's state and h an encoder state.
# `vitscope.attention.AdditiveAttention` is that score, a softmax over the source words (pads
# masked) and the weighted sum, the **context vector**. (Luong et al. called this score *concat*
# and set it beside two cheaper ones, the dot product sᵀh and the bilinear sᵀW h, which they
# called *general*.)

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
assert (alpha[1, 6:] == 0).all()  # the second sentence's three pads get no weight

# %% [markdown]
# ## A language pair with known alignments
#
# `vitscope.translate.make_pair` draws sentences of a small synthetic language pair from a seed. The
# source puts adjectives after the noun and the verb in the middle; the target puts each clause's
# verb last and its adjectives before the noun in mirror order, and a few words become two. Every
# target word records the source word it translates, so we can later check where the attention
# looked. Train and test sentences never overlap. For the heatmap below we pick the longest of the
# first 50 test sentences in which no word appears twice (exercise 3 looks at one where one does).

# %%
pair = make_pair(seed=0, train_size=4000, test_size=600, max_words=16)
data = ParallelData.build(pair)
no_repeats = [e for e in pair.test[:50] if len(set(e.source)) == len(e.source)]
example = max(no_repeats, key=lambda e: len(e.source))  # the longest with no word twice
print("source:", " ".join(example.source))
print("target:", " ".join(example.target))
print("gold:  ", example.alignment)
assert not {e.source for e in pair.train} & {e.source for e in pair.test}

# %% [markdown]
# ## The RNN translator with attention
#
# The encoder is a bidirectional GRU over the source words: h_i (the forward and backward states
# side by side) is source word i in its context. The decoder is a GRU that writes the target one
# word at a time (`vitscope.translate.RNNTranslator`). At step t, having written y_{t−1}:
#
# - s_t = GRU([E y_{t−1} ; c_{t−1}], s_{t−1}): read the previous word and the previous context;
# - α_t = softmax_i(vᵀ tanh(W_s s_t + W_h h_i)): score every source word with the additive score;
# - c_t = Σ_i α_ti h_i: the context, the attention-weighted sum of the encoder's states;
# - p(y_t) = softmax(W_o tanh(W [s_t ; c_t ; E y_{t−1}])): choose the next word.
#
# The score is Bahdanau's, but the order is **Luong's**: the query is s_t, the state *after*
# reading the previous word, and the context c_{t−1} is fed back in with the previous word (Luong
# et al.'s "input feeding" feeds back the vector they make from the context), so the decoder knows
# where it looked last. Bahdanau's decoder asks with s_{t−1}, the state *before* reading y_{t−1}, and
# feeds the new context c_t into the GRU that makes s_t.
#
# We do not expect the difference to matter for the alignment, though only Luong's order is trained
# here. In both orders α_t are the weights that make the context for writing y_t, and they learn
# from how much that context helps to predict y_t (and, through the recurrence, the words after
# it); so in both they are pushed to peak on the source word y_t translates. What changes is what
# the query knows: s_t has read y_{t−1}, while s_{t−1} is the state from which y_{t−1} was chosen,
# so it holds the model's prediction of that word, not the word itself. Both know how far the
# translation has come, which is what finding the next source word needs.
#
# It trains on the same loop as vitscope's classifiers and captioners (`vitscope train --task
# translate` on the command line). Small settings here: 4,000 sentences of up to 16 words, three
# passes, one thread; the full preset is `vitscope train --preset translate_rnn` (its settings:
# `vitscope.training.recipes.translate_rnn`).

# %%
root = Path(tempfile.mkdtemp())
settings = dict(task="translate", dataset="synthetic_pair", batch_size=32, lr=3e-3, min_lr=1e-4, weight_decay=0.0,
                warmup_epochs=0.1, label_smoothing=0.0, amp="fp32", kernels=False, threads=1, explain_images=4)
sizes = {"embed_dim": 64, "hidden_dim": 64, "attn_dim": 64, "drop": 0.0}
sentences = dict(translator="rnn", train_sentences=4000, test_sentences=600, max_words=16)
run_dir = root / "attention"
result = train(TrainConfig(**settings, epochs=3, eval_every_steps=25,
                           translate=TranslateOptions(**sentences, decoder_args={**sizes, "attention": True})),
               run_dir, progress=False)
print(result.describe(), f"after {result.train_time_s:.0f} s of training")

# %% [markdown]
# ## Did it learn the alignment?
#
# `evaluate_translations` translates the 600 test sentences greedily (the most likely word at each
# step) and reads the attention teacher-forced on the reference translation, so every target word
# has a gold source word; **alignment accuracy** is the share of target words whose attention peaks
# on it. No alignment was given in training.

# %%
translator = open_translator(run_dir / "last.safetensors")  # the weights at the end, not picked on the test set
with_attention = evaluate_translations(translator.model, data.test, data.tgt_vocab)
metrics = with_attention.metrics
print(f"exact sentences {100 * metrics['exact_match']:.1f}%, tokens {100 * metrics['token_accuracy']:.1f}%, "
      f"BLEU-4 {metrics['bleu4']:.3f}, alignment {100 * metrics['alignment']:.1f}%")
assert metrics["exact_match"] > 0.8
assert metrics["alignment"] > 0.85

# %% [markdown]
# The heatmap: source words along the top, the target words down the side, each row one word's
# attention. The boxes are the gold alignment (cyan where the peak is on it, red where it is not).
# The reordering is visible: each verb is written last in its clause but looked up in the middle,
# and the adjectives come before their noun and in mirror order.

# %%
i = data.test.examples.index(example)
attention = teacher_forced_attention(translator.model, data, i)  # (T, N)
fig = alignment_figure(example.source, example.target, attention, gold=example.alignment,
                       title="RNN with additive attention: where each target word looked")
display(fig)
peaks = attention.argmax(-1).tolist()
hits = sum(p == g for p, g in zip(peaks, example.alignment))
print("peaks:", peaks)
print(f"{hits} of {len(peaks)} target words peak on their gold source word")
assert hits >= 0.8 * len(peaks)

# %% [markdown]
# Where does the attention miss? A source word that becomes two target words ("visits" becomes
# "va ke") is one place to look: once the first of the two is written, the second follows from it,
# and the decoder has little reason to look at the source again. We count, over every test
# sentence, the misses on such second words against all the misses:

# %%
from vitscope.sequence import trim_padding  # noqa: E402
from vitscope.translate.evaluate import teacher_forced  # noqa: E402

src, tgt = trim_padding(data.test.src), trim_padding(data.test.tgt)  # (S, N), (S, T): no all-pad columns
with torch.no_grad():
    _, all_attention = teacher_forced(translator.model.eval(), src, tgt)  # (S, T-1, N)
gold = data.test.gold[:, : all_attention.shape[1]]                    # (S, T-1), -1: no gold word
missed = (all_attention.argmax(-1) != gold) & (gold >= 0)
second_word = torch.zeros_like(missed)
second_word[:, 1:] = (gold[:, 1:] == gold[:, :-1]) & (gold[:, 1:] >= 0)  # same source word as the word before
misses, on_second = int(missed.sum()), int((missed & second_word).sum())
display(Markdown(
    f"{misses} of the {int((gold >= 0).sum())} target words of the test sentences miss their gold source word, "
    f"and {on_second} of those misses ({100 * on_second / max(misses, 1):.0f}%) are the second word of a two-word "
    f"translation, though such words are only {100 * int(second_word.sum()) / int((gold >= 0).sum()):.0f}% of the "
    f"target words."))
assert on_second > 0.5 * misses

# %% [markdown]
# ## The bottleneck: the same RNN without attention
#
# Before attention, an encoder–decoder passed the whole source sentence to the decoder as one
# fixed-size vector (Sutskever et al., 2014; Cho et al., 2014), and Cho, van Merriënboer, Bahdanau
# and Bengio ("On the Properties of Neural Machine Translation", 2014) found its translations got
# worse as sentences got longer (Sutskever et al.'s deep LSTMs, reading the source reversed, held
# up better). vitscope builds that model from the same parts with `attention=False`: the decoder
# reads c = [the forward state after the last word ; the backward state after the first] at every
# step instead of c_t. It gets more passes (five to three), since its steps are cheaper, and is
# evaluated once per pass instead of every 25 steps; both models are scored from their last
# weights.

# %%
bottleneck = TranslateOptions(**sentences, decoder_args={**sizes, "attention": False})
no_attention_run = train(TrainConfig(**settings, epochs=5, translate=bottleneck),
                         root / "no_attention", progress=False)
print(no_attention_run.describe(), f"after {no_attention_run.train_time_s:.0f} s of training")
no_attention = evaluate_translations(open_translator(root / "no_attention" / "last.safetensors").model, data.test,
                                    data.tgt_vocab)


def exact_between(by_length, lo, hi):
    """Exact sentence accuracy over the test sentences of lo to hi source words, and how many there are."""
    groups = [(accuracy, n) for length, (accuracy, n) in by_length.items() if lo <= length <= hi]
    count = sum(n for _, n in groups)
    return sum(accuracy * n for accuracy, n in groups) / count, count


bands = [(3, 6), (7, 10), (11, 13), (14, 16)]
print(f"{'source words':>12} {'sentences':>9} {'attention':>9} {'without':>9}")
for lo, hi in bands:
    acc, n = exact_between(with_attention.by_length, lo, hi)
    acc_without, _ = exact_between(no_attention.by_length, lo, hi)
    print(f"{f'{lo}-{hi}':>12} {n:>9} {100 * acc:>8.1f}% {100 * acc_without:>8.1f}%")

fig = accuracy_by_length_figure(
    {f"with attention, 3 passes ({result.train_time_s:.0f} s)": with_attention.by_length,
     f"without attention, 5 passes ({no_attention_run.train_time_s:.0f} s)": no_attention.by_length},
    title=f"Exact sentence accuracy against source length ({len(data.test)} test sentences, greedy)")
display(fig)

# %%
short, long_ = bands[0], bands[-1]
att_short, att_long = (exact_between(with_attention.by_length, *b)[0] for b in (short, long_))
no_short, no_long = (exact_between(no_attention.by_length, *b)[0] for b in (short, long_))
display(Markdown(
    f"Without attention the RNN translates {100 * no_short:.0f}% of the sentences of {short[0]}-{short[1]} "
    f"words exactly and {100 * no_long:.0f}% of those of {long_[0]}-{long_[1]}: a fixed-size vector holds a short "
    f"sentence, not a long one. Longer training lifts both but leaves a wide gap between them (the full presets' "
    f"runs in benchmarks/RESULTS.md). With attention the decoder reads the source again at every word, and the "
    f"fall with length is far smaller: {100 * att_short:.0f}% of the short sentences and {100 * att_long:.0f}% of the "
    f"long ones exactly."))
assert no_short > no_long + 0.3  # without attention, accuracy falls with length
assert att_long > no_long + 0.5 and att_long > 0.8  # with it, long sentences are not lost
assert att_short - att_long < 0.5 * (no_short - no_long)  # and the fall with length is less than half

# %% [markdown]
# ## Watching the alignment emerge
#
# Nobody told the model where to look, so when did it find out? Every run keeps the attention of four
# test sentences, teacher-forced on their references, before the first step and at each evaluation (here
# every 25 steps: `eval_every_steps=25`), in `probes.safetensors` beside its metrics. `read_probes` reads
# them back, `probes_figure` draws one sentence at four steps side by side, and the explorer below shows the
# same under a slider over every step.

# %%
from vitscope.inspect import probes_figure, read_probes  # noqa: E402

probes = read_probes(run_dir)
display(probes_figure(probes))
gold_of = {tuple(e.source): e.alignment for e in data.test.examples}


def probe_hits(step: int) -> float:
    """The share of the probed sentences' target words whose attention peaks on their gold source word."""
    hits = total = 0
    for k, item in enumerate(probes.inputs):
        gold = gold_of[tuple(item["source"])]
        peaks = probes.attention(step)[k, : len(gold), : len(item["source"])].argmax(-1).tolist()
        hits += sum(p == g for p, g in zip(peaks, gold))
        total += len(gold)
    return hits / total


curve = {s: probe_hits(s) for s in probes.steps}
print("step: share of target words whose attention peaks on their gold source word")
print("  ".join(f"{s}: {100 * v:.0f}%" for s, v in curve.items()))
first_good = next(s for s, v in curve.items() if v >= 0.8)
print(f"the probed sentences' alignment first reaches 80% at step {first_good} of {probes.steps[-1]}")
assert curve[probes.steps[-1]] > 0.8

# Before the first step: each target word's row of weights, its entropy against a uniform row's, log N
rows0 = [probes.attention(0)[k, : len(gold_of[tuple(item["source"])]), : len(item["source"])]
         for k, item in enumerate(probes.inputs)]  # (T, N) per probed sentence
evenness = min((-(r * r.clamp_min(1e-12).log()).sum(-1) / math.log(r.shape[1])).min().item() for r in rows0)
chance = sum(r.shape[0] / r.shape[1] for r in rows0) / sum(r.shape[0] for r in rows0)  # a peak put at random
display(Markdown(
    f"Before training the attention is spread almost evenly (the first panel): every row's entropy is at least "
    f"{100 * evenness:.1f}% of a uniform row's. Its peak then lands on the gold word for {100 * curve[0]:.0f}% of "
    f"the target words, where a peak put at random would land on it for {100 * chance:.0f}%: in a nearly flat row "
    f"the untrained model's small preferences decide where the peak falls. "
    f"The shares printed above say when the alignment appears; the explorer's slider below shows it forming."))
assert evenness > 0.9 and curve[0] < 0.5 * curve[probes.steps[-1]]

# %% [markdown]
# ## The translation explorer
#
# The explorer shows the attention of several sentences at once: pick a sentence, read its
# translation (beam search here), click one of its words and see where it looked, a bar over each
# source word with the gold one underlined, and the whole sentence's heatmap below. Given the run's probes
# it adds "Over training": move its slider from step 0 to the end to watch the alignment form. In a notebook
# it shows inline; `.save("translations.html")` writes the same page to a file.

# %%
from vitscope.inspect.translate_explorer import translate_explorer_data, translate_page  # noqa: E402

shown = data.test.examples[:8]
translations = translator.translate([e.source for e in shown], beam=3)
page = translate_page(translate_explorer_data(
    [t.source for t in translations], [t.words for t in translations], [t.attention for t in translations],
    gold=[e.alignment for e in shown], references=[e.target for e in shown], probes=probes))
display(page)

# %% [markdown]
# The run also wrote `alignment.png` and `translations.html` (the same explorer over its first test
# sentences, with the same slider), `probes.png` (the figure above), beside its config, its summary and its
# training curves:

# %%
print(sorted(p.name for p in run_dir.iterdir() if p.suffix in (".png", ".html", ".json")))

# %% [markdown]
# ## What we checked

# %%
display(Markdown("\n".join([
    "- Parameter-free attention softmax(X Xᵀ) X, scaled dot-product attention with queries, keys and values, "
    "multi-head attention and cross-attention give PyTorch's results to 1e-5.",
    "- Masked keys, causal or padding, get weight exactly 0.",
    "- Bahdanau's additive attention is an MLP score, a masked softmax and a weighted sum.",
    f"- An RNN translator with additive attention, trained for {result.train_time_s:.0f} s, translates "
    f"{100 * metrics['exact_match']:.1f}% of {len(data.test)} unseen sentences word for word, and its attention, "
    f"never told where to look, peaks on the source word each target word translates for "
    f"{100 * metrics['alignment']:.1f}% of the target words: the alignment Bahdanau et al. found.",
    f"- The same RNN without attention, trained for {no_attention_run.train_time_s:.0f} s, translates "
    f"{100 * no_short:.0f}% of the sentences of {short[0]}-{short[1]} words and {100 * no_long:.0f}% of those of "
    f"{long_[0]}-{long_[1]}: the bottleneck attention removed.",
])))

# %% [markdown]
# Full runs, the transformer translator and its heads: the [translate guide](../guide/translate.md)
# and `benchmarks/RESULTS.md`.
#
# ## Exercises
#
# Each is a change to a cell above; rerun from that cell.
#
# 1. In the additive attention cell, drop the `torch.tanh` from the scores by hand and compute the
#    weights for two different decoder states. Why are they the same? (Write vᵀ(W_s s + W_h h) as
#    two terms and ask which of them changes from one source word to the next.)
# 2. Train the attention RNN for one pass instead of three (`epochs=1`). Which comes first, the
#    alignment or the right translations? Compare `alignment` with `exact_match`.
# 3. Draw the heatmap for a test sentence in which a word appears twice, e.g.
#    `example = next(e for e in pair.test if e.source.count("but") == 2)`. Where do the target words
#    of the second clause look? The encoder's states of two copies of a word differ only by their
#    context.
# 4. Give the RNN without attention a state twice as wide (`"hidden_dim": 128`). Does the gap
#    between short and long sentences close, and at what cost in training time?
# 5. Decode both models with `evaluate_translations(..., beam=5)`. Does beam search rescue the long
#    sentences of the model without attention?
# 6. Train with `eval_every_steps=5` for one epoch and find the step where `probe_hits` first passes 50%.
#    Is it the same step where the training loss falls fastest (`metrics.jsonl`)?
# 7. Train `translator="transformer"` with `decoder_args={"dim": 64, "depth": 2, "num_heads": 4}`
#    instead of the RNN, and read `alignment_per_head`: which heads align?

# %%
print(f"this run took {time.perf_counter() - started:.0f} s")

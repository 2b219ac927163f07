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
# # 1. Attention from scratch
#
# Attention is a weighted average whose weights the data chooses. Every token asks a question (its
# **query**), every token offers something to match against (its **key**) and a content to hand over
# (its **value**); the softmax of the query–key scores says how much of each value to take.
#
# Attention came to neural networks through translation. Bahdanau, Cho and Bengio (2014) let a decoder
# score every source word with a small MLP (additive attention); Luong, Pham and Manning (2015) compared
# several scores (dot, general, concat), the plain dot product among them; Vaswani et al. (2017) built the
# transformer on the dot product scaled by 1/√d, with queries, keys and values projected from the sequence
# itself, several heads side by side, and masks. [Tutorial 3](03_dot_product_to_translation.py) goes back
# to translation. This one builds today's form from the ground up:
#
# 1. attention as a weighted average, first of all as kernel regression;
# 2. the simplest form, softmax(X Xᵀ) X, with no parameters at all;
# 3. the equation softmax(QKᵀ/√d)V, worked by hand in numbers you can check;
# 4. multi-head self-attention in a few lines of [einops](https://einops.rocks), checked against
#    `vitscope.MultiHeadAttention` and `torch.nn.MultiheadAttention` on the same weights;
# 5. why the scores are divided by √d;
# 6. the causal and padding masks;
# 7. order: attention cannot see it, and what positional encodings must do about that.
#
# The test suite runs this file; each `assert` checks a fact the text states, and fails the tests if
# it stops being true. Exercises close the tutorial.
#
# As recorded on our machine (yours will differ), it ran in 17 to 38 seconds (executed as the tests
# execute it, in a Jupyter kernel) on 2 cores of an AMD EPYC (Zen 3, AVX2) shared with other jobs; the
# last cell prints how long your run took.

# %%
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from IPython.display import Markdown, display

import vitscope
from vitscope.attention import causal_mask
from vitscope.inspect import entropy
from vitscope.positional import sincos_1d

started = time.perf_counter()
torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

# %% [markdown]
# ## 1. A weighted average: kernel regression
#
# Before any neural network: we have 40 noisy samples (x_i, y_i) of a curve and want to predict y
# at new points x. Each prediction is a weighted average of the y_i,
#
# f(x) = Σ_i α(x, x_i) y_i,  with the weights α(x, ·) ≥ 0 summing to 1.
#
# In attention's words the new point x is the **query**, the x_i are the **keys** and the y_i the
# **values**. Three ways to choose the weights:
#
# - **a plain average**, α = 1/n: every prediction is the same number, the mean of the y_i;
# - **similarity weights** (Nadaraya and Watson, 1964): a Gaussian kernel of the distance,
#   α(x, x_i) = softmax_i(−(x − x_i)² / 2w²), so samples near the query count most; the width w
#   is chosen by hand, here w = 1;
# - **learned weights**: the same kernel with w learned by gradient descent.

# %%
def curve(x):
    return torch.sin(2 * x) + 0.4 * x


def kernel_regression(queries, keys, values, width, *, leave_one_out=False):
    """Gaussian-kernel weights (Nq, Nk) and the weighted averages of the values (Nq,)."""
    scores = -((queries[:, None] - keys[None, :]) / width) ** 2 / 2  # (Nq, Nk)
    if leave_one_out:  # a training point may not look at its own label
        scores = scores.masked_fill(torch.eye(len(queries), dtype=torch.bool), float("-inf"))
    weights = scores.softmax(dim=-1)
    return weights @ values, weights


generator = torch.Generator().manual_seed(0)
x_train = (torch.rand(40, generator=generator) * 5).sort().values  # keys
y_train = curve(x_train) + 0.3 * torch.randn(40, generator=generator)  # values
x_query = torch.linspace(0, 5, 60)  # queries


def error(prediction):
    return ((prediction - curve(x_query)) ** 2).mean().item()


average_weights = torch.full((60, 40), 1 / 40)
gaussian, gaussian_weights = kernel_regression(x_query, x_train, y_train, width=1.0)

# %% [markdown]
# To learn the width, each training point is predicted from the *other* training points (the
# mask on the diagonal: otherwise the best width is 0, where each point copies its own label), and
# the squared error is minimised. We learn log w, which keeps w positive.

# %%
log_width = torch.zeros((), requires_grad=True)  # w = 1 to start
optimizer = torch.optim.SGD([log_width], lr=0.5)
for _ in range(200):
    fit, _ = kernel_regression(x_train, x_train, y_train, log_width.exp(), leave_one_out=True)
    loss = ((fit - y_train) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
learned_width = log_width.exp().item()
learned, learned_weights = kernel_regression(x_query, x_train, y_train, learned_width)

errors = {"plain average": error(average_weights @ y_train), "Gaussian, w = 1": error(gaussian),
          f"Gaussian, learned w = {learned_width:.3f}": error(learned)}
for name, value in errors.items():
    print(f"{name:<30} mean squared error against the true curve {value:.3f}")

# %%
fig, axes = plt.subplots(1, 4, figsize=(14, 3.3), layout="constrained")
axes[0].plot(x_query, curve(x_query), c="gray", lw=1, label="true curve")
axes[0].scatter(x_train, y_train, s=10, c="k", label="samples (keys, values)")
axes[0].plot(x_query, average_weights @ y_train, label="plain average")
axes[0].plot(x_query, gaussian, label="Gaussian, w = 1")
axes[0].plot(x_query, learned, label=f"learned w = {learned_width:.2f}")
axes[0].set(xlabel="x", ylabel="y")
axes[0].legend(fontsize=7)
top = learned_weights.max().item()  # one colour scale for the three maps
for ax, w, title in zip(axes[1:], [average_weights, gaussian_weights, learned_weights],
                        ["plain average", "Gaussian, w = 1", f"learned w = {learned_width:.2f}"]):
    im = ax.imshow(w, cmap="viridis", aspect="auto", extent=(0, 5, 5, 0), vmin=0, vmax=top)
    ax.set(title=f"weights: {title}", xlabel="key x_i", ylabel="query x")
fig.colorbar(im, ax=axes[1:], fraction=0.03, label="weight")
display(fig)
plt.close(fig)

# %% [markdown]
# Each heatmap row is one query's weights over the 40 samples. The plain average spreads every row
# evenly; the Gaussian puts each row's weight on the samples near the query, a band along the
# diagonal; the learned width narrows the band and follows the curve more closely.

# %%
err = list(errors.values())
assert err[0] > err[1] > err[2]  # each step predicts better than the one before
assert learned_width < 1.0  # the band the data chose is narrower than the hand-picked one

# %% [markdown]
# The Gaussian score is a dot product in disguise. Expand the square:
# −(x − x_i)²/2w² = x·x_i/w² − x_i²/2w² − x²/2w². The last term is the same for every key in a
# row, and a softmax does not change when the same number is added to a whole row, so the weights
# are softmax_i(x·x_i/w² − x_i²/2w²): a scaled dot product of query and key, plus a term per key.
# When every key has the same length, that term drops out too and this is exactly dot-product
# attention.

# %%
w = learned_width
as_dot_product = (x_query[:, None] * x_train[None, :] / w**2 - x_train[None, :] ** 2 / (2 * w**2)).softmax(-1)
assert torch.allclose(as_dot_product, learned_weights, atol=1e-5)  # the algebra above, checked in numbers

# %% [markdown]
# Here one number was learned. Attention learns much more: projections that turn each token into a
# query and a key, so the network decides what "similar" means.
#
# ## 2. The simplest form: softmax(X Xᵀ) X
#
# Strip away every parameter: each token is its own query, key and value, and the scores are the
# dot products X Xᵀ. This is not where attention began (in translation it began with Bahdanau's
# learned scores), but it is the form with nothing left to take away. `vitscope.dot_product_attention` computes it.
# We make the tokens unit vectors, so no token is louder than another.

# %%
x = torch.randn(6, 16)
x = x / x.norm(dim=-1, keepdim=True)  # unit length

weights_by_hand = (x @ x.T).softmax(dim=-1)  # (N, N)
out_by_hand = weights_by_hand @ x            # (N, D)
out, weights = vitscope.dot_product_attention(x, return_weights=True)
assert torch.allclose(out, out_by_hand, atol=1e-6) and torch.allclose(weights, weights_by_hand, atol=1e-6)
print(weights)
print("each token's weight on itself:", weights.diagonal())

# %% [markdown]
# Each token's weight on itself is the largest in its row: for unit vectors x·y ≤ |x||y| = 1 =
# x·x (Cauchy–Schwarz). But it is not most of the row. Random unit vectors in 16 dimensions are
# nearly orthogonal, so a token scores about 1 with itself and about 0 with the others, and its
# own weight comes out near e¹ / (e¹ + (N − 1)·e⁰) = e / (e + N − 1): a third of the row for 6
# tokens, and less the longer the sequence. We measure it over 200 draws at each length:

# %%
print(f"{'N':>3} {'own weight':>10} {'e/(e+N-1)':>10}")
own_weights = {}
for n in (3, 6, 12, 48):
    draws = F.normalize(torch.randn(200, n, 16, generator=generator), dim=-1)  # (draws, N, D) unit vectors
    own_weights[n] = (draws @ draws.transpose(-2, -1)).softmax(-1).diagonal(dim1=-2, dim2=-1).mean().item()
    print(f"{n:>3} {own_weights[n]:>10.3f} {math.e / (math.e + n - 1):>10.3f}")
assert all(abs(own - math.e / (math.e + n - 1)) < 0.02 for n, own in own_weights.items())

# %% [markdown]
# The unit length matters. Without it a longer token can outscore a token's own dot product
# (x·y = |x||y| cos θ exceeds x·x = |x|² when |y| cos θ > |x|), and then a token's largest weight
# is on another token. With 5 Gaussian tokens of width 8, count how often that happens:

# %%
raw = torch.randn(5000, 5, 8, generator=generator)  # not normalised
peaks = (raw @ raw.transpose(-2, -1)).softmax(-1).argmax(-1)  # (draws, N)
elsewhere = (peaks != torch.arange(5)).any(-1).float().mean().item()
print(f"draws in which some token's largest weight is on another token: {100 * elsewhere:.1f}%")
assert elsewhere > 0.05

# %% [markdown]
# The scores X Xᵀ are symmetric (token i scores token j as j scores i), but the weights are not:
# the softmax divides row i by its own sum Σ_j exp(x_i·x_j), and rows have different sums.

# %%
print("largest |weight_ij - weight_ji|:", (weights - weights.T).abs().max().item())
assert not torch.allclose(weights, weights.T, atol=1e-3)

# %% [markdown]
# With no parameters nothing can be learned: a token can only look for tokens like itself. Learned
# query and key projections are what let "what I look for" differ from "what I am", and a value
# projection what lets "what I hand over" differ from both.
#
# ## 3. The attention equation, by hand
#
# Vaswani et al. (2017) write the whole of it in one line:
#
# Attention(Q, K, V) = softmax(Q Kᵀ / √d) V
#
# Q (Nq, d) holds one query per row, K (Nk, d) one key per row and V (Nk, dv) one value per row.
# Q Kᵀ (Nq, Nk) is every query's dot product with every key; dividing by √d keeps the scores from
# growing with the width (section 5 shows why that matters); the softmax turns each row into
# weights; multiplying by V takes each query's weighted average of the values.
#
# A worked example small enough to do on paper: three tokens, d = 4 (so √d = 2), values of width 2.

# %%
Q = torch.tensor([[2., 0., 2., 0.],
                  [0., 2., 0., 0.],
                  [1., 1., 1., 1.]])
K = torch.tensor([[1., 0., 1., 0.],
                  [0., 1., 0., 1.],
                  [1., 1., 0., 0.]])
V = torch.tensor([[1., 0.],
                  [0., 1.],
                  [1., 1.]])

scores = Q @ K.T                        # (3, 3)
scaled = scores / math.sqrt(K.shape[1])  # divide by √4 = 2
exps = scaled.exp()
weights = exps / exps.sum(-1, keepdim=True)
out = weights @ V
for name, t in [("Q Kᵀ", scores), ("Q Kᵀ / √d", scaled), ("exp", exps), ("weights", weights), ("output", out)]:
    print(f"{name}\n{t}\n")

# %%
row = [f"{v:.3f}" for v in exps[0].tolist()]
display(Markdown(
    f"Row 1, by hand: the first query scores the keys {scores[0].int().tolist()}; divided by 2 that is "
    f"{scaled[0].int().tolist()}; exponentiated, e² = {row[0]}, e⁰ = {row[1]}, e¹ = {row[2]}, which sum to "
    f"{exps[0].sum():.3f}; so the weights are {', '.join(f'{v:.3f}' for v in weights[0].tolist())}, and the output "
    f"is {weights[0, 0]:.3f}·(1, 0) + {weights[0, 1]:.3f}·(0, 1) + {weights[0, 2]:.3f}·(1, 1) = "
    f"({out[0, 0]:.3f}, {out[0, 1]:.3f}). The third query scores every key the same, so its weights are "
    f"equal and its output is the plain average of the values, ({out[2, 0]:.3f}, {out[2, 1]:.3f})."))

# %% [markdown]
# `vitscope.attend` is this equation on (B, H, N, D) tensors, one batch and one head here:

# %%
assert torch.allclose(vitscope.attend(Q[None, None], K[None, None], V[None, None])[0, 0], out, atol=1e-6)

# %% [markdown]
# ## 4. Multi-head self-attention in einops
#
# In **self-attention** queries, keys and values all come from the same sequence, each through its
# own learned projection. A sequence of N tokens of width `dim` goes in as `x` (B, N, dim). One
# linear layer makes the queries, keys and values of all H heads at once (width 3·H·D); einops
# splits them, one head per D channels. Each head attends on its own; the heads are put side by
# side again and mixed by an output projection.

# %%
def multi_head_self_attention(x, w_qkv, b_qkv, w_out, b_out, num_heads):
    qkv = x @ w_qkv.T + b_qkv                                                    # (B, N, 3·H·D)
    q, k, v = rearrange(qkv, "b n (three h d) -> three b h n d", three=3, h=num_heads)
    scores = einsum(q, k, "b h i d, b h j d -> b h i j") / q.shape[-1] ** 0.5  # (B, H, N, N)
    weights = scores.softmax(dim=-1)                                              # (B, H, N, N)
    out = einsum(weights, v, "b h i j, b h j d -> b h i d")                       # (B, H, N, D)
    return rearrange(out, "b h n d -> b n (h d)") @ w_out.T + b_out              # (B, N, dim)


# %% [markdown]
# `vitscope.MultiHeadAttention` keeps timm's parameter names: one fused `qkv` linear and an
# output `proj`. We run our function on its weights.

# %%
dim, heads, batch, tokens = 64, 8, 2, 10
mha = vitscope.MultiHeadAttention(dim, num_heads=heads).eval()
x = torch.randn(batch, tokens, dim)

ours = multi_head_self_attention(x, mha.qkv.weight, mha.qkv.bias, mha.proj.weight, mha.proj.bias, heads)
with torch.no_grad():
    theirs = mha(x)
print("largest difference to vitscope.MultiHeadAttention:", (ours - theirs).abs().max().item())
assert torch.allclose(ours, theirs, atol=1e-5)

# %% [markdown]
# PyTorch's own `nn.MultiheadAttention` stores the same three projections as `in_proj_weight`
# (queries, then keys, then values, each split into heads the same way) and the output projection
# as `out_proj`. Copy the weights over and the two modules agree:

# %%
torch_mha = torch.nn.MultiheadAttention(dim, heads, batch_first=True).eval()
with torch.no_grad():
    torch_mha.in_proj_weight.copy_(mha.qkv.weight)
    torch_mha.in_proj_bias.copy_(mha.qkv.bias)
    torch_mha.out_proj.weight.copy_(mha.proj.weight)
    torch_mha.out_proj.bias.copy_(mha.proj.bias)
    reference, reference_weights = torch_mha(x, x, x, average_attn_weights=False)
    _, vitscope_weights = mha(x, return_weights=True)

print("largest difference to torch.nn.MultiheadAttention:", (ours - reference).abs().max().item())
assert torch.allclose(ours, reference, atol=1e-5)
assert torch.allclose(vitscope_weights, reference_weights, atol=1e-5)  # (B, H, N, N), the same maps

# %% [markdown]
# ## 5. Why divide by √d?
#
# If the entries of a query and a key are independent with mean 0 and variance 1, their dot product
# over D dimensions has variance D. Without the scale, wider heads give ever larger scores, and the
# softmax of large scores is nearly one-hot: each query sees a single key, and since the softmax's
# Jacobian diag(p) − ppᵀ shrinks as p nears one-hot (it is zero at a one-hot p), less and less
# gradient reaches the scores.
# Dividing by √D brings the variance back to 1 whatever the width.
#
# We measure it on random queries and keys (32 keys, so uniform attention has entropy log 32
# nats, the dashed line in the plot), with `vitscope.inspect.entropy`, the mean entropy of the attention rows.

# %%
def softmax_jacobian_norm(weights):
    """Frobenius norm of d softmax / d scores, diag(p) - p pᵀ, averaged over rows."""
    jac = torch.diag_embed(weights) - weights[..., :, None] * weights[..., None, :]
    return jac.flatten(-2).norm(dim=-1).mean().item()


widths = [4, 16, 64, 256, 1024]
rows = []
for d in widths:
    q = torch.randn(64, 1, 32, d, generator=generator)
    k = torch.randn(64, 1, 32, d, generator=generator)
    scores = q @ k.transpose(-2, -1)
    raw, scaled = scores.softmax(-1), (scores / d**0.5).softmax(-1)
    rows.append({
        "D": d, "score std": scores.std().item(),
        "entropy raw": entropy(raw).item(), "entropy scaled": entropy(scaled).item(),
        "max weight raw": raw.amax(-1).mean().item(), "max weight scaled": scaled.amax(-1).mean().item(),
        "jacobian raw": softmax_jacobian_norm(raw), "jacobian scaled": softmax_jacobian_norm(scaled),
    })

print(f"{'D':>5} {'score std':>9} {'√D':>5} | {'entropy':>15} | {'max weight':>15} | {'|d softmax|':>15}")
print(f"{'':>5} {'':>9} {'':>5} | {'raw':>7} {'scaled':>7} | {'raw':>7} {'scaled':>7} | {'raw':>7} {'scaled':>7}")
for r in rows:
    print(f"{r['D']:>5} {r['score std']:>9.1f} {r['D'] ** 0.5:>5.1f} | {r['entropy raw']:>7.2f} "
          f"{r['entropy scaled']:>7.2f} | {r['max weight raw']:>7.2f} {r['max weight scaled']:>7.2f} | "
          f"{r['jacobian raw']:>7.3f} {r['jacobian scaled']:>7.3f}")
assert all(abs(r["score std"] / r["D"] ** 0.5 - 1) < 0.1 for r in rows)  # the std of q·k is √D

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")
for key, label in [("raw", "softmax(q·k)"), ("scaled", "softmax(q·k / √D)")]:
    axes[0].plot(widths, [r[f"entropy {key}"] for r in rows], marker="o", label=label)
    axes[1].plot(widths, [r[f"max weight {key}"] for r in rows], marker="o", label=label)
axes[0].axhline(math.log(32), ls="--", c="gray", lw=1, label="uniform (log 32)")
axes[0].set(xscale="log", xlabel="head width D", ylabel="entropy of a row (nats)")
axes[1].set(xscale="log", xlabel="head width D", ylabel="mean largest weight", ylim=(0, 1))
for ax in axes:
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
display(fig)
plt.close(fig)

# %%
first, last = rows[0], rows[-1]
display(Markdown(
    f"Without the scale the rows collapse: at D = {last['D']} the largest weight takes "
    f"{last['max weight raw']:.2f} of a row on average (entropy {last['entropy raw']:.2f} nats), and the softmax's "
    f"Jacobian is {last['jacobian raw'] / last['jacobian scaled']:.2f} times the scaled one's. With the scale every "
    f"width keeps an entropy between {min(r['entropy scaled'] for r in rows):.2f} and "
    f"{max(r['entropy scaled'] for r in rows):.2f} nats."))
assert last["max weight raw"] > 0.9 and last["entropy raw"] < 0.2
ratios = [r["jacobian raw"] / r["jacobian scaled"] for r in rows]  # raw Jacobian ÷ scaled, per width
assert ratios[-1] < 0.4 and ratios[-1] < ratios[0] / 3  # it falls as the width grows
assert all(abs(r["entropy scaled"] - first["entropy scaled"]) < 0.1 for r in rows)
assert all(r["max weight scaled"] < 0.25 for r in rows)

# %% [markdown]
# ## 6. Masks: causal and padding
#
# Masks decide which keys a query may see. vitscope follows
# `torch.nn.functional.scaled_dot_product_attention`: a boolean mask is **True where a query may
# look**. (`torch.nn.MultiheadAttention` uses the opposite convention for its boolean masks: True
# there means *masked out*. Mixing the two up is a classic bug.)
#
# A **causal** mask lets token i see tokens 0..i only, so a decoder cannot read the word it is
# asked to predict. `vitscope.attend` takes it as `causal=True`:

# %%
q, k, v = torch.randn(3, 2, 4, 7, 16).unbind(0)  # (B, H, N, D) each
out = vitscope.attend(q, k, v, causal=True)
reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
print(causal_mask(7, 7).int())
assert torch.allclose(out, reference, atol=1e-5)

# the same by hand: masked scores become -inf, so they get weight exactly 0
scores = einsum(q, k, "b h i d, b h j d -> b h i j") / 16**0.5
by_hand = scores.masked_fill(~causal_mask(7, 7), float("-inf")).softmax(-1) @ v
assert torch.allclose(out, by_hand, atol=1e-5)

# %% [markdown]
# The point of the causal mask: changing a later token must not change any earlier output.

# %%
k2, v2 = k.clone(), v.clone()
k2[:, :, 5:], v2[:, :, 5:] = torch.randn(2, 2, 4, 2, 16)  # new tokens 5 and 6
changed = vitscope.attend(q, k2, v2, causal=True)
assert torch.allclose(changed[:, :, :5], out[:, :, :5])  # tokens 0..4 did not notice
assert not torch.allclose(changed[:, :, 5:], out[:, :, 5:])

# %% [markdown]
# A **padding** mask hides the filler at the end of short sequences in a batch. From the true
# lengths `vitscope.key_padding_mask` makes a (B, 1, 1, N) mask, True at real keys, which
# broadcasts over heads and queries.

# %%
lengths = torch.tensor([7, 4])
mask = vitscope.key_padding_mask(lengths)
print(mask[:, 0, 0].int())
out, weights = vitscope.attend(q, k, v, mask=mask, return_weights=True)
assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-5)
assert weights[1, :, :, 4:].abs().max() == 0  # the second sequence's padding gets no attention

# %% [markdown]
# The same through the modules: `vitscope.MultiHeadAttention` takes the mask, and
# `torch.nn.MultiheadAttention` takes the padding as `key_padding_mask` (True at padding) and the
# causal mask as `attn_mask` (True where *not* allowed).

# %%
x = torch.randn(2, 7, dim)
padded = ~mask[:, 0, 0]  # (B, N), True at padding: PyTorch's module convention
with torch.no_grad():
    ours = mha(x, mask=mask, causal=True)
    theirs, _ = torch_mha(x, x, x, key_padding_mask=padded, attn_mask=~causal_mask(7, 7))
print("largest difference with both masks:", (ours - theirs).abs().max().item())
assert torch.allclose(ours, theirs, atol=1e-5)

# %% [markdown]
# ## 7. Order
#
# Self-attention has no idea where a token stands. Permute the tokens of the input and the output
# is the same rows, permuted the same way: the layer is **permutation-equivariant**. The reason is
# in the equation: permuting the rows of X permutes the rows of Q, K and V, so it permutes both the
# rows and the columns of the scores, the row-wise softmax follows, and the weighted sums land in
# the permuted rows. "dog bites man" and "man bites dog" would give the same three output vectors,
# only in a different order.

# %%
x = torch.randn(1, 7, dim)
perm = torch.randperm(7, generator=generator)
with torch.no_grad():
    plain, plain_permuted = mha(x), mha(x[:, perm])
print("permutation:", perm.tolist())
print("largest |f(permuted x) - permuted f(x)|:", (plain_permuted - plain[:, perm]).abs().max().item())
assert torch.allclose(plain_permuted, plain[:, perm], atol=1e-5)

# %% [markdown]
# Two things break it. **Positions**: add to each token a code for the place it stands in; the
# codes stay where they are when the tokens move, so the layer sees different inputs. **A causal
# mask**: token 0 sees only itself, token 6 sees everyone, so the result depends on who stands where.

# %%
positions = sincos_1d(7, dim)  # (N, dim): one code per position, section below
with torch.no_grad():
    with_positions = mha(x + positions), mha(x[:, perm] + positions)
    causal = mha(x, causal=True), mha(x[:, perm], causal=True)
for name, (before, after) in [("positions added", with_positions), ("causal mask", causal)]:
    print(f"{name:<16} largest difference: {(after - before[:, perm]).abs().max().item():.3f}")
    assert not torch.allclose(after, before[:, perm], atol=1e-3)

# %% [markdown]
# A transformer decoder has both: positions on its inputs and the causal mask on its
# self-attention. An encoder, and a ViT, have no causal mask (at most a padding mask, which hides
# pads and says nothing about order): there positions are the only source of order.
#
# ### What a positional encoding needs
#
# What should the code of position p be? It needs
#
# 1. **a unique code per position**, so two places never look alike;
# 2. **consistent distances across lengths**: the step from p to p + k means the same in a short
#    sequence as in a long one, and at the start as at the end;
# 3. **to generalise to longer sequences** than those seen in training;
# 4. **to be deterministic and bounded**: the same code every time, and values that do not grow
#    with p (the index p itself, or p as a number added to every channel, grows without bound and
#    would drown the tokens' content).
#
# The obvious candidates each miss one. The index p is unbounded. The fraction p / (N − 1) is
# bounded, but its step between neighbours is 1/(N − 1), so the same distance gets a different
# code at every length. A learned table (as the ViT uses) has no row for a position past the
# longest one it was trained with (to fine-tune on larger images, the ViT paper interpolates its
# table to the new grid: `vitscope.positional.resample_pos_embed`).
#
# Vaswani et al.'s **sinusoids** meet the first, second and fourth, and the third as far as an
# encoding can: channel pair i holds sin(p·ω_i) and cos(p·ω_i) at a
# frequency ω_i = 1/10000^(2i/d) that falls from 1 to nearly 1/10000 across the channels, so the
# wavelengths run from 2π to nearly 10000·2π. `vitscope.positional.sincos_1d` computes them.

# %%
pe = sincos_1d(100, 64)  # (positions, channels)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), layout="constrained")
im = axes[0].imshow(pe.T, cmap="RdBu", aspect="auto", vmin=-1, vmax=1)
axes[0].set(xlabel="position p", ylabel="channel", title="sincos_1d(100, 64): one column per position")
fig.colorbar(im, ax=axes[0], fraction=0.04)
for channel in (4, 12, 24, 40):
    axes[1].plot(pe[:, channel], label=f"channel {channel}: sin(p·{1 / 10000 ** (channel / 64):.3g})")
axes[1].set(xlabel="position p", ylabel="value", title="a few channels: fast to slow")
axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
display(fig)
plt.close(fig)

# %% [markdown]
# Each property, checked on 1,000 positions of width 64:

# %%
pe = sincos_1d(1000, 64)
distances = torch.cdist(pe, pe) + torch.eye(1000) * 1e9  # leave out each position's distance to itself
print(f"1. the two closest codes are {distances.min().item():.3f} apart (codes lie in [-1, 1])")

steps = {k: (pe[k:] - pe[:-k]).norm(dim=-1) for k in (1, 5, 50)}  # |PE[p+k] - PE[p]| for every p
for k, s in steps.items():
    print(f"2. |PE[p+{k}] - PE[p]| = {s.mean().item():.4f} for every p (spread {(s.max() - s.min()).item():.1e})")
fractions = {n: 1 / (n - 1) for n in (10, 100)}
print("   against p/(N-1), whose neighbour step is", ", ".join(f"{v:.3f} at N = {n}" for n, v in fractions.items()))

short = sincos_1d(20, 64)
print("2. nor does a position's code depend on the length: sincos_1d(20) = first rows of sincos_1d(1000):",
      torch.equal(short, pe[:20]), "(p/(N-1) of position 5:", f"{5 / 19:.3f} at N = 20, {5 / 999:.3f} at N = 1000)")
longer = sincos_1d(4000, 64)
itself = torch.cat([torch.zeros(3000, 1000), torch.eye(3000)], 1) * 1e9  # leave out each one's own code
beyond = torch.cdist(longer[1000:], longer) + itself  # positions 1,000-3,999 against all 4,000
print(f"3. positions 1,000-3,999 get codes too: the closest any of them comes to another code is "
      f"{beyond.min().item():.3f}")
print(f"4. every value lies in [{longer.min().item():.3f}, {longer.max().item():.3f}], whatever the position")
assert distances.min() > 0.1
assert all((s.max() - s.min()) < 1e-3 for s in steps.values())
assert torch.equal(short, pe[:20])
assert beyond.min() > 0.1 and torch.equal(longer[:1000], pe)
assert longer.abs().max() <= 1

# %% [markdown]
# Property 2 has a stronger form, the one Vaswani et al. chose sinusoids for: for every offset k,
# PE[p + k] is the same linear function of PE[p] at every position p. Each (sin, cos) pair turns by
# the angle k·ω_i (sin(a + b) = sin a cos b + cos a sin b, cos(a + b) = cos a cos b − sin a sin b),
# so one block-diagonal rotation M_k, built from the frequencies alone, moves every code k places,
# at any position. Vaswani et al. hoped that this would let a model attend by relative position
# and extrapolate to longer sequences. It is a property of the codes, not a guarantee about the
# model: the scores mix the codes with the tokens' content through learned projections, and in
# practice transformers with sinusoids degrade on sequences longer than those they were trained
# on (Press, Smith and Lewis 2022, who proposed ALiBi for that reason).

# %%
def shift_by(k, dim):
    """M_k (dim, dim): PE[p] @ M_k = PE[p + k], one 2x2 rotation per (sin, cos) channel pair."""
    angles = k / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = angles.cos(), angles.sin()
    return torch.block_diag(*[torch.stack([torch.stack([c, -s]), torch.stack([s, c])]) for c, s in zip(cos, sin)])


m3 = shift_by(3, 64).float()
moved = pe[:-3] @ m3
print("largest |PE[p] M_3 - PE[p+3]| over p = 0..996:", (moved - pe[3:]).abs().max().item())
assert torch.allclose(moved, pe[3:], atol=1e-4)

# %% [markdown]
# ### Adding or concatenating
#
# The transformer **adds** the code to the token's embedding (Vaswani et al. multiply the embeddings
# by √d_model first); the ViT adds a learned table. **Concatenating** [token ; code] keeps the two
# apart in separate channels, and the score of two tokens splits cleanly into a content part and a
# position part: [x_i ; p_i]·[x_j ; p_j] = x_i·x_j + p_i·p_j. Adding keeps the width, but the score
# of (x_i + p_i)·(x_j + p_j) has two cross terms as well, content against position:

# %%
tokens_ = torch.randn(2, 64, generator=generator)  # two tokens' content
codes = sincos_1d(10, 64)[[2, 7]]                   # at positions 2 and 7
terms = {"content·content": tokens_[0] @ tokens_[1], "position·position": codes[0] @ codes[1],
         "content·position": tokens_[0] @ codes[1], "position·content": codes[0] @ tokens_[1]}
for name, value in terms.items():
    print(f"{name:<18} {value.item():7.3f}")
print(f"{'concatenated score':<18} {torch.cat([tokens_[0], codes[0]]) @ torch.cat([tokens_[1], codes[1]]):7.3f}")
print(f"{'added score':<18} {(tokens_[0] + codes[0]) @ (tokens_[1] + codes[1]):7.3f}")

# %% [markdown]
# The cross terms are not a loss: the learned query and key projections decide how much of each
# term a head uses, and in many dimensions content and codes can sit in nearly separate directions.
# What concatenation costs is width: every layer after it is wider, or the content gets fewer
# channels. In practice adding works, and it is what the transformer and the ViT do.
#
# ## What we checked
#
# - Kernel regression is attention with one learned number: a plain average, then Gaussian
#   weights, then a learned width, each predicting better than the one before; its Gaussian score
#   is a scaled dot product plus a term per key.
# - In parameter-free attention softmax(X Xᵀ) X of unit vectors a token's own weight is the largest
#   in its row, but only about e / (e + N − 1) of it; the scores are symmetric, the weights are not.
# - softmax(QKᵀ/√d)V on three tokens by hand equals `vitscope.attend`.
# - Multi-head self-attention is a few lines of einops, and gives `vitscope.MultiHeadAttention`'s
#   and `torch.nn.MultiheadAttention`'s outputs to 1e-5 on the same weights; vitscope's and torch's
#   attention weights agree to 1e-5 too.
# - Without 1/√D, dot products grow with the head width, the softmax saturates and passes less and
#   less gradient; with it, the rows keep the same entropy at every width.
# - Causal and padding masks give `F.scaled_dot_product_attention`'s results, and a causal output
#   does not depend on later tokens.
# - Self-attention is permutation-equivariant; added positions and a causal mask each break that.
#   Sinusoidal codes are unique, bounded, the same at every length, and one rotation per offset
#   moves them at every position.
#
# ## Exercises
#
# Each is a change to a cell above; rerun from that cell.
#
# 1. In section 1, set the width to 0.05 and then to 5 in `kernel_regression(x_query, ...)`. How do
#    the heatmap and the error change? Which one overfits the noise?
# 2. In section 1, train without `leave_one_out=True`. Where does the learned width go, and why?
# 3. In section 2, multiply the unit vectors by 3 before the softmax. How big is a token's own
#    weight now? What does the length of the vectors act as?
# 4. In section 3, change the third query to (2, 2, 2, 2). Do its weights change? Why not, and what
#    would change them?
# 5. In `multi_head_self_attention`, drop the `/ q.shape[-1] ** 0.5`. Which assert fails, and by how
#    much do the outputs differ? Then print `entropy(weights)` inside the function with and without
#    the scale, at `dim = 512`.
# 6. In section 7, swap only tokens 3 and 4 and call `mha(..., causal=True)`. Which output rows
#    change? Why do rows 0–2 and 5–6 not?
# 7. Replace `sincos_1d` by the fraction p/(N − 1) in every channel and redo the checks of
#    section 7: which properties fail?
#
# Next: [Pixel attention and the ViT](02_pixel_attention_and_vit.py), where attention moves from
# tokens to images.

# %%
print(f"this run took {time.perf_counter() - started:.0f} s")

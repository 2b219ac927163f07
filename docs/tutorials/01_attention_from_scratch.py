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
# **query**), every token offers an answer to match against (its **key**) and a content to hand over
# (its **value**); the softmax of the query–key dot products says how much of each value to take.
#
# This tutorial builds multi-head self-attention in a few lines of [einops](https://einops.rocks),
# checks it against `vitscope.MultiHeadAttention` and `torch.nn.MultiheadAttention` on the same
# weights, shows why the scores are divided by √d, starts again from the parameter-free
# softmax(X Xᵀ) X, and ends with the two masks every sequence model needs. Every claim below is an
# `assert`: the tutorial is run by the test suite, so if one stops being true, the tests fail.
#
# It runs in a few seconds on a laptop CPU.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from IPython.display import display

import vitscope
from vitscope.attention import causal_mask
from vitscope.inspect import entropy

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

# %% [markdown]
# ## Multi-head self-attention in einops
#
# A sequence of N tokens of width `dim` goes in as `x` (B, N, dim). One linear layer makes queries,
# keys and values for all H heads at once (width 3·H·D); einops splits them, one head per D
# channels. Each head attends on its own; the heads are put side by side again and mixed by an
# output projection.

# %%
def multi_head_self_attention(x, w_qkv, b_qkv, w_out, b_out, num_heads):
    qkv = x @ w_qkv.T + b_qkv                                                    # (B, N, 3·H·D)
    q, k, v = rearrange(qkv, "b n (three h d) -> three b h n d", three=3, h=num_heads)
    scores = einsum(q, k, "b h i d, b h j d -> b h i j") / q.shape[-1] ** 0.5  # (B, H, N, N)
    weights = scores.softmax(dim=-1)                                              # each row sums to 1
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
assert torch.allclose(vitscope_weights.sum(-1), torch.ones(batch, heads, tokens))

# %% [markdown]
# ## Why divide by √d?
#
# If the entries of a query and a key are independent with mean 0 and variance 1, their dot product
# over D dimensions has variance D. Without the scale, wider heads give ever larger scores, and the
# softmax of large scores is nearly one-hot: each query sees a single key, and since the softmax's
# Jacobian diag(p) − ppᵀ vanishes at a one-hot p, almost no gradient reaches the scores.
# Dividing by √D brings the variance back to 1 whatever the width.
#
# We measure it on random queries and keys (32 keys, so uniform attention has entropy
# log 32 ≈ 3.47 nats), with `vitscope.inspect.entropy`, the mean entropy of the attention rows.

# %%
def softmax_jacobian_norm(weights):
    """Frobenius norm of d softmax / d scores, diag(p) - p pᵀ, averaged over rows."""
    jac = torch.diag_embed(weights) - weights[..., :, None] * weights[..., None, :]
    return jac.flatten(-2).norm(dim=-1).mean().item()


generator = torch.Generator().manual_seed(0)
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

print(f"{'D':>5} {'score std':>9} | {'entropy':>15} | {'max weight':>15} | {'|d softmax|':>15}")
print(f"{'':>5} {'':>9} | {'raw':>7} {'scaled':>7} | {'raw':>7} {'scaled':>7} | {'raw':>7} {'scaled':>7}")
for r in rows:
    print(f"{r['D']:>5} {r['score std']:>9.1f} | {r['entropy raw']:>7.2f} {r['entropy scaled']:>7.2f} | "
          f"{r['max weight raw']:>7.2f} {r['max weight scaled']:>7.2f} | "
          f"{r['jacobian raw']:>7.3f} {r['jacobian scaled']:>7.3f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")
for key, label in [("raw", "softmax(q·k)"), ("scaled", "softmax(q·k / √D)")]:
    axes[0].plot(widths, [r[f"entropy {key}"] for r in rows], marker="o", label=label)
    axes[1].plot(widths, [r[f"max weight {key}"] for r in rows], marker="o", label=label)
axes[0].axhline(torch.log(torch.tensor(32.0)).item(), ls="--", c="gray", lw=1, label="uniform (log 32)")
axes[0].set(xscale="log", xlabel="head width D", ylabel="entropy of a row (nats)")
axes[1].set(xscale="log", xlabel="head width D", ylabel="mean largest weight", ylim=(0, 1))
for ax in axes:
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
display(fig)
plt.close(fig)

# %% [markdown]
# Without the scale the rows collapse: at D = 1024 the largest weight takes almost all of each row
# and the softmax passes almost no gradient. With it, the rows look the same at every width.

# %%
first, last = rows[0], rows[-1]
assert last["max weight raw"] > 0.9 and last["entropy raw"] < 0.2
assert last["jacobian raw"] < 0.25 * last["jacobian scaled"]
assert all(abs(r["entropy scaled"] - first["entropy scaled"]) < 0.1 for r in rows)
assert all(r["max weight scaled"] < 0.25 for r in rows)

# %% [markdown]
# ## Attention with no parameters: softmax(X Xᵀ) X
#
# Strip away the projections and every token is its own query, key and value. This is where the
# history of attention starts, and `vitscope.dot_product_attention` computes it.

# %%
x = torch.randn(6, 16)
x = x / x.norm(dim=-1, keepdim=True)  # unit length, so no token is louder than another

weights_by_hand = (x @ x.T).softmax(dim=-1)  # (N, N)
out_by_hand = weights_by_hand @ x            # (N, D)
out, weights = vitscope.dot_product_attention(x, return_weights=True)
assert torch.allclose(out, out_by_hand, atol=1e-6) and torch.allclose(weights, weights_by_hand, atol=1e-6)
print(weights)

# %% [markdown]
# With no parameters there is nothing to learn, and the weights say something unhelpful: a token
# is most similar to itself (for vectors of equal length, x·y ≤ |x||y| = x·x by Cauchy–Schwarz), so
# every token mostly looks at itself. Learned query, key and value projections are what let a
# token look for something other than its own reflection; the matrix is also symmetric
# (X Xᵀ = (X Xᵀ)ᵀ), so "what I look for" is always "what I am".

# %%
assert torch.equal(weights.argmax(dim=-1), torch.arange(6))
scores = x @ x.T
assert torch.allclose(scores, scores.T)

# %% [markdown]
# ## Masks: causal and padding
#
# Masks decide which keys a query may see. vitscope follows
# `torch.nn.functional.scaled_dot_product_attention`: a boolean mask is **True where a query may
# look**. (`torch.nn.MultiheadAttention` uses the opposite convention for its boolean masks: True
# there means *masked out*. Mixing the two up is a classic bug.)
#
# A **causal** mask lets token i see tokens 0..i only, so a decoder cannot read the word it is
# asked to predict. `vitscope.attend` is the scaled dot-product attention on (B, H, N, D) tensors:

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
assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 7))

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
# ## What we checked
#
# - Multi-head self-attention is a dozen lines of einops, and gives `vitscope.MultiHeadAttention`'s
#   and `torch.nn.MultiheadAttention`'s outputs and weights to 1e-5 on the same weights.
# - Without 1/√D, dot products grow with the head width, the softmax saturates (largest weight
#   above 0.9 at D = 1024) and stops passing gradient; with it, the rows keep the same entropy at
#   every width.
# - Parameter-free attention softmax(X Xᵀ) X mostly looks at itself, which is why attention learns
#   query, key and value projections.
# - Causal and padding masks give `F.scaled_dot_product_attention`'s results, and a causal output
#   does not depend on later tokens.
#
# Next: [Pixel attention and the ViT](02_pixel_attention_and_vit.py), where attention moves from
# tokens to images.

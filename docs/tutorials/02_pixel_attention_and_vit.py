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
# # 2. Pixel attention and the Vision Transformer
#
# Tutorial 1 built attention over a sequence of tokens. An image is not a sequence, but it can be
# made into one in two ways: every **pixel** of a feature map becomes a token, or every
# **patch** of the image does. This tutorial does both:
#
# 1. self-attention over the pixels of a convolutional feature map, by hand and with
#    `vitscope.SpatialSelfAttention`, checked equal; then its multi-head version;
# 2. the Vision Transformer built piece by piece in plain PyTorch, each piece beside its equation,
#    and its weights copied into `vitscope.VisionTransformer`, which gives the same logits;
# 3. a small ViT trained on Fashion-MNIST for 300 steps, with a plain PyTorch loop;
# 4. a look inside it with `vitscope.inspect`: attention rollout, the four regions of its
#    attention matrix, the mean attention distance of every head, and which heads it needs;
# 5. the same model trained for 10 epochs with another recipe (a checkpoint kept beside this tutorial, with the
#    command that made it): its position table has learned the grid and its heads have become
#    selective, and we hold its mean attention distances up against the ViT paper's;
# 6. a ViT that first learned to paint hidden patches back (the ViT paper's masked patch
#    prediction, in SimMIM's form), whose heads did become local, watched as they became so;
# 7. the same with noise on every patch, which after fine-tuning has its nearest heads in the first
#    layer and looks farther layer by layer, the ViT paper's order (though only mildly local).
#
# The notebook this follows trains its ViT on photos of pets (Oxford-IIIT Pet). Those cannot be
# downloaded where this tutorial is built and tested, so it uses Fashion-MNIST, which vitscope reads
# from local files: 28 × 28 grey images of ten kinds of clothing. (With the Pet files on disk,
# `load_dataset("pets", root=...)` reads them, and `vitscope train --dataset pets` trains on them.)
#
# Time, as recorded on our machine (yours will differ): 73 s (executed as the tests execute it, in a
# Jupyter kernel, OpenMP's threads waiting passively as the `vitscope` command sets them) on 2 cores of an
# AMD EPYC Zen 3 while another training ran beside it; 12 minutes when other jobs kept the cores busy and
# the threads spun at every barrier. The last cell prints how long your run took.

# %%
import json
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from einops import einsum, rearrange
from IPython.display import Markdown, display
from torch import nn

import vitscope
from vitscope import SpatialSelfAttention, VisionTransformer, ViTConfig, create_model
from vitscope.data import eval_transform, load_dataset
from vitscope.inspect import (
    REGIONS,
    ablation_importance,
    attention_modules,
    capture_attention,
    evaluate,
    head_stats,
    patch_distances,
    pruning_curve,
    rollout,
    rollout_map,
)
from vitscope.inspect.plots import (
    plot_distance,
    plot_heads_grid,
    plot_importance,
    plot_overlays,
    plot_pruning,
    plot_regions,
    uniform_distance,
)
from vitscope.weights import load_model

tutorial_start = time.perf_counter()
torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

train = load_dataset("fashion_mnist", "train")
test = load_dataset("fashion_mnist", "test")
print(train.images.shape, train.images.dtype, train.classes)

# every split is normalised with the training split's mean and standard deviation
x_train, y_train = eval_transform(train.images, train.mean, train.std), train.labels
x_test, y_test = eval_transform(test.images, train.mean, train.std), test.labels

# %% [markdown]
# ## Self-attention over the pixels of a feature map
#
# A convolution sees a small neighbourhood; attention lets every pixel look at every other one.
# Take a feature map (N, C, H, W), normalise it, read it as N sequences of H·W tokens of width C,
# attend, project back, and add the input. The addition is a residual connection: the block
# computes a correction to its input rather than a replacement, and the gradient reaches the input
# through the sum unchanged. (It does not make the block start as the identity: the output
# projection starts random, so the correction starts as a random one; the next cell prints how big.)
# Here the feature map comes from one convolution over eight test images.

# %%
conv = torch.nn.Conv2d(1, 32, kernel_size=3, stride=2, padding=1)
with torch.no_grad():
    features = conv(x_test[:8])  # (N, C, H, W) = (8, 32, 14, 14)


def pixel_self_attention(f, norm, w_qkv, b_qkv, w_out, b_out, num_heads):
    n, c, h, w = f.shape
    tokens = rearrange(norm(f), "n c h w -> n (h w) c")                             # (N, H·W, C)
    q, k, v = rearrange(tokens @ w_qkv.T + b_qkv, "n p (three h d) -> three n h p d", three=3, h=num_heads)
    weights = (einsum(q, k, "n h i d, n h j d -> n h i j") / q.shape[-1] ** 0.5).softmax(-1)
    out = rearrange(einsum(weights, v, "n h i j, n h j d -> n h i d"), "n h p d -> n p (h d)")
    out = out @ w_out.T + b_out                                                       # (N, H·W, C)
    return f + rearrange(out, "n (h w) c -> n c h w", h=h, w=w), weights


attention = SpatialSelfAttention(32, num_heads=1, norm="group", groups=8).eval()
with torch.no_grad():
    theirs, their_weights = attention(features, return_weights=True)
    ours, our_weights = pixel_self_attention(features, attention.norm, attention.attn.qkv.weight,
                                             attention.attn.qkv.bias, attention.attn.proj.weight,
                                             attention.attn.proj.bias, num_heads=1)
print("output", tuple(ours.shape), "weights", tuple(our_weights.shape))
print("largest difference to SpatialSelfAttention:", (ours - theirs).abs().max().item())
assert torch.allclose(ours, theirs, atol=1e-5) and torch.allclose(our_weights, their_weights, atol=1e-5)
change = ((ours - features).norm() / features.norm()).item()
print(f"untrained, the block changes its input by {change:.1%} (relative norm): not the identity")

# %% [markdown]
# Even untrained, a pixel's attention depends on the image: the projections are random, but the
# features are the image's, so the weights can follow the garment's shapes. Below, the attention of
# the pixel at the centre of each image over all 14 × 14 pixels.

# %%
centre = 7 * 14 + 7  # row-major index of pixel (7, 7)
fig, axes = plt.subplots(2, 4, figsize=(8, 4.2), layout="constrained")
for i, ax in enumerate(axes.ravel()):
    ax.imshow(test.images[i, 0], cmap="gray")
    ax.imshow(rearrange(our_weights[i, 0, centre], "(h w) -> h w", h=14), cmap="inferno", alpha=0.6,
              extent=(-0.5, 27.5, 27.5, -0.5))
    ax.plot(14, 14, "c+", ms=10)
    ax.set_title(test.classes[int(y_test[i])], fontsize=9)
    ax.axis("off")
fig.suptitle("Where the centre pixel (+) looks, untrained pixel attention")
display(fig)
plt.close(fig)

# %% [markdown]
# ## Multi-head pixel attention: one group of channels per head
#
# With H heads, the C channels of the queries, keys and values are cut into H groups of C/H
# channels, and each group attends on its own. Head g's weights use channels g·C/H to (g+1)·C/H
# only; we check that on every head.

# %%
heads = 4
attention4 = SpatialSelfAttention(32, num_heads=heads, norm="group", groups=8).eval()
with torch.no_grad():
    _, weights4 = attention4(features, return_weights=True)  # (N, H, H·W, H·W)
    tokens = rearrange(attention4.norm(features), "n c h w -> n (h w) c")
    q, k, _ = (tokens @ attention4.attn.qkv.weight.T + attention4.attn.qkv.bias).chunk(3, dim=-1)
group = 32 // heads
for g in range(heads):
    channels = slice(g * group, (g + 1) * group)
    by_hand = (q[..., channels] @ k[..., channels].transpose(-2, -1) / group**0.5).softmax(-1)
    assert torch.allclose(by_hand, weights4[:, g], atol=1e-5)
print(f"{heads} heads of {group} channels each; weights {tuple(weights4.shape)}")

# %% [markdown]
# The catch is the size of the attention matrix: (H·W)² per head and image. That is why the
# Vision Transformer attends over patches instead of pixels.

# %%
for name, tokens_per_image in [("14 x 14 feature map", 14 * 14), ("28 x 28 pixels", 28 * 28),
                               ("224 x 224 pixels", 224 * 224), ("224 x 224 in 16 x 16 patches", 14 * 14),
                               ("28 x 28 in 4 x 4 patches", 7 * 7)]:
    print(f"{name:>30}: {tokens_per_image:>6} tokens, {tokens_per_image**2:>13,} weights per head")
print(f"a 224 x 224 image in 16 x 16 patches: {(224 * 224) ** 2 // (14 * 14) ** 2:,} times fewer weights "
      "than over its pixels")

# %% [markdown]
# ## The Vision Transformer, piece by piece
#
# The ViT paper (Dosovitskiy et al., ICLR 2021, "An image is worth 16x16 words") writes the whole model
# in four lines. An image is cut into N patches x_p¹ … x_pᴺ of P × P pixels and C channels, each
# flattened to a vector of P²·C numbers; then
#
# | | equation | what it says |
# |---|---|---|
# | (1) | z₀ = [x_class; x_p¹E; …; x_pᴺE] + E_pos | E (P²·C × D) projects each patch; class token first; add positions |
# | (2) | z′ₗ = MSA(LN(zₗ₋₁)) + zₗ₋₁ | pre-norm block, first half: LayerNorm, multi-head self-attention, residual |
# | (3) | zₗ = MLP(LN(z′ₗ)) + z′ₗ | second half: LayerNorm, a two-layer MLP with GELU, residual (ℓ = 1 … L) |
# | (4) | y = LN(z_L⁰) | the class token's output, normalised, is the image's vector; a linear head makes the logits |
#
# We build each line in plain PyTorch on a batch of eight test images, with the sizes of the model
# we train below: patches of P = 4 (a 7 × 7 grid, N = 49), width D = 32, 4 heads, 4 blocks, an
# MLP twice as wide as the tokens.
#
# **Patches.** einops cuts and flattens in one pattern that spells out the shapes:
# `b c (h p1) (w p2) -> b (h w) (p1 p2 c)`.

# %%
P, D, HEADS, DEPTH, MLP_RATIO = 4, 32, 4, 4, 2.0
x = x_test[:8]                                                               # (B, C, H, W)
patches = rearrange(x, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=P, p2=P)  # (B, N, P²·C)
to_embedding = nn.Linear(P * P * 1, D)                                       # E, and a bias
patch_tokens = to_embedding(patches)                                         # (B, N, D)
print("images", tuple(x.shape), "-> patches", tuple(patches.shape), "-> tokens", tuple(patch_tokens.shape))

# %% [markdown]
# One matrix applied to every P × P patch on its own is a convolution whose kernel is P × P and
# whose stride is P (the patches do not overlap). That is how vitscope and timm write it
# (`patch_embed.proj` is a `Conv2d`). The same weights, reshaped, give the same tokens:

# %%
patch_conv = nn.Conv2d(1, D, kernel_size=P, stride=P)
with torch.no_grad():
    patch_conv.weight.copy_(rearrange(to_embedding.weight, "d (p1 p2 c) -> d c p1 p2", p1=P, p2=P))
    patch_conv.bias.copy_(to_embedding.bias)
    by_conv = rearrange(patch_conv(x), "b d h w -> b (h w) d")  # (B, D, 7, 7) -> (B, N, D)
print("conv output", tuple(patch_conv(x).shape), "; largest difference to the Linear:",
      (by_conv - patch_tokens).abs().max().item())
assert torch.allclose(by_conv, patch_tokens, atol=1e-5)

# %% [markdown]
# **The class token and the positions**, equation (1). The class token x_class is one learned
# vector of width D, the same for every image, put in front of the patches; it holds nothing about
# the image at the start, and collects what it needs through attention, block after block. The
# positions E_pos are a learned table with one row per token (1 + N rows): attention alone cannot
# tell where a patch came from (permute the patches and every output permutes with them), so each
# token is told by adding its row. Both start as small random numbers, as in timm.

# %%
cls_token = nn.Parameter(torch.randn(1, 1, D) * 0.02)
pos_embed = nn.Parameter(torch.randn(1, 1 + 49, D) * 0.02)
z0 = torch.cat([cls_token.expand(len(x), -1, -1), patch_tokens], dim=1) + pos_embed  # (B, 1 + N, D)
print("z0", tuple(z0.shape), "= class token + 49 patch tokens, each of width", D)

# %% [markdown]
# **The block**, equations (2) and (3). Multi-head self-attention is tutorial 1's: one Linear makes
# the queries, keys and values of every head at once, each head computes softmax(QKᵀ/√d)V over
# all 50 tokens, and a last Linear mixes the heads' outputs. The MLP works on each token alone.
# The LayerNorm comes *before* each sublayer (pre-norm, as the ViT paper has it; the 2017
# Transformer normalised after the residual), so the residual path from input to output carries
# the tokens untouched by any norm. We use LayerNorm's ε = 10⁻⁶, timm's and the paper's code's
# value (PyTorch's default is 10⁻⁵).

# %%
class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, z):                                                                # (B, N, D)
        q, k, v = rearrange(self.to_qkv(z), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        weights = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).softmax(-1)            # (B, H, N, N)
        return self.to_out(rearrange(weights @ v, "b h n d -> b n (h d)"))               # (B, N, D)


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, z):
        z = z + self.attn(self.norm1(z))     # (2) z' = MSA(LN(z)) + z
        return z + self.mlp(self.norm2(z))   # (3) z  = MLP(LN(z')) + z'


block = Block(D, HEADS, int(D * MLP_RATIO))
z1 = block(z0)
print("one block:", tuple(z0.shape), "->", tuple(z1.shape))

# %% [markdown]
# **The head**, equation (4): normalise the tokens, take the class token's, and map it to one
# logit per class. The whole model is those pieces in a row:

# %%
class HandViT(nn.Module):
    def __init__(self, patch=P, dim=D, heads=HEADS, depth=DEPTH, mlp_ratio=MLP_RATIO, grid=7, classes=10):
        super().__init__()
        self.patch = patch
        self.to_embedding = nn.Linear(patch * patch, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + grid * grid, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads, int(dim * mlp_ratio)) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):                                                                  # (B, C, H, W)
        patches = rearrange(x, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=self.patch, p2=self.patch)
        z = self.to_embedding(patches)                                                       # (B, N, D)
        z = torch.cat([self.cls_token.expand(len(z), -1, -1), z], dim=1) + self.pos_embed  # (1)
        for block in self.blocks:
            z = block(z)                                                                     # (2), (3)
        return self.head(self.norm(z)[:, 0])                                                 # (4): (B, classes)


hand = HandViT().eval()
print(f"{sum(p.numel() for p in hand.parameters()):,} parameters; logits", tuple(hand(x).shape))

# %% [markdown]
# ### The same numbers from vitscope
#
# `vitscope.VisionTransformer` is the same model, written with timm's parameter names so that timm
# checkpoints load as they are. Copy our weights into it under those names (the patch Linear
# reshaped into the Conv2d's kernel, as above) and it must give the same logits.

# %%
vit = VisionTransformer(ViTConfig(img_size=28, patch_size=P, in_chans=1, num_classes=10, embed_dim=D,
                                  depth=DEPTH, num_heads=HEADS, mlp_ratio=MLP_RATIO)).eval()
state = {"patch_embed.proj.weight": rearrange(hand.to_embedding.weight, "d (p1 p2 c) -> d c p1 p2", p1=P, p2=P),
         "patch_embed.proj.bias": hand.to_embedding.bias, "cls_token": hand.cls_token,
         "pos_embed": hand.pos_embed, "norm.weight": hand.norm.weight, "norm.bias": hand.norm.bias,
         "head.weight": hand.head.weight, "head.bias": hand.head.bias}
ours_to_timm = {"norm1": "norm1", "attn.to_qkv": "attn.qkv", "attn.to_out": "attn.proj", "norm2": "norm2",
                "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2"}
for i, b in enumerate(hand.blocks):
    for ours_name, timm_name in ours_to_timm.items():
        module = b.get_submodule(ours_name)
        state[f"blocks.{i}.{timm_name}.weight"] = module.weight
        state[f"blocks.{i}.{timm_name}.bias"] = module.bias
print(vit.load_state_dict(state, strict=True))  # strict: every name matched, none left over
with torch.no_grad():
    diff = (hand(x) - vit(x)).abs().max().item()
print(f"largest logit difference, by hand vs vitscope: {diff:.2e}")
assert torch.allclose(hand(x), vit(x), atol=1e-5)

# %% [markdown]
# ### A class token, or the average of the patches?
#
# The class token is BERT's idea, which the ViT paper kept. The other way to get one vector per
# image is to average the patch tokens' outputs (global average pooling), as a CNN does; the ViT
# paper's appendix finds both work about equally well once each gets its own learning rate,
# and later ViTs (e.g. "Better plain ViT baselines", Beyer et al. 2022) use the average. vitscope
# has both: `class_token=False, global_pool="avg"` drops the token and averages, and then
# (timm's rule) the LayerNorm moves after the pooling (`fc_norm`). The difference shows in what the
# attention maps mean: with a class token, "where the model looks" is the class token's row of
# the last layer; with averaging there is no such row, and vitscope's plots use the mean of the
# patch rows instead.

# %%
avg = VisionTransformer(ViTConfig(img_size=28, patch_size=P, in_chans=1, num_classes=10, embed_dim=D,
                                  depth=DEPTH, num_heads=HEADS, mlp_ratio=MLP_RATIO, class_token=False,
                                  global_pool="avg")).eval()
with torch.no_grad():
    tokens_out = avg.forward_features(x)                         # (B, N, D): no class token now
    by_hand = avg.head(avg.fc_norm(tokens_out.mean(dim=1)))      # average, then LayerNorm, then head
print("tokens without a class token:", tuple(tokens_out.shape))
assert torch.allclose(by_hand, avg(x), atol=1e-5)

# %% [markdown]
# ### Why a ViT needs so much data
#
# Compare what a convolution assumes with what this model assumes. A convolution looks at a small
# neighbourhood (locality) and applies the same weights at every position, so a shifted image gives
# a shifted feature map (translation equivariance); both are built in, whatever the data. The ViT
# builds in much less: the patch projection is local within each patch, and the MLP treats every
# token alike, but attention connects every patch to every other from the first layer, and the
# positions are a table of random numbers that says nothing about which patches are neighbours.
# That 2-D structure has to be learned from the data. The paper's Figure 3 shows the consequence:
# pre-trained on ImageNet (1.3M images) alone, ViT-L/16 falls behind ViT-B/16, and the ViTs behind
# the BiT ResNets; pre-trained on ImageNet-21k (14M images) they draw level, and on JFT-300M the
# large ViTs pull ahead. Little
# inductive bias is a handicap with little data and an advantage with a lot.
#
# We can watch the position table learn the grid. Below, the cosine similarity of each patch's
# position vector to every other's, for the table above (random, as at the start of training) and
# for the 10-epoch model we load later in this tutorial.

# %%
here = Path.cwd()
CHECKPOINT_NAME = "vit_fmnist_10ep.safetensors"
candidates = [here / "checkpoints", here / "docs" / "tutorials" / "checkpoints",
              Path(vitscope.__file__).resolve().parents[2] / "docs" / "tutorials" / "checkpoints"]
checkpoint = next((c / CHECKPOINT_NAME for c in candidates if (c / CHECKPOINT_NAME).exists()), None)
assert checkpoint is not None, f"{CHECKPOINT_NAME} not found in {[str(c) for c in candidates]}"
trained = load_model(checkpoint)  # rebuilt from the config in the file's metadata, in eval mode
print(trained.config.embed_dim, "wide,", trained.config.depth, "blocks of", trained.config.num_heads, "heads")


def position_similarity(table):                                  # (1 + N, D) -> (N, N) cosine similarity
    p = F.normalize(table[1:].detach(), dim=-1)                   # the patch rows (row 0 is the class token's)
    return p @ p.T


grid_distance = patch_distances(capture_attention(trained, x[:1]).layout) / P   # (N, N), in patches


def neighbours_vs_far(sim):
    off_diagonal = ~torch.eye(len(sim), dtype=torch.bool)
    near = sim[(grid_distance == 1) & off_diagonal].mean().item()
    far = sim[(grid_distance >= 4) & off_diagonal].mean().item()
    return near, far


fig, axes = plt.subplots(2, 7, figsize=(10, 3.4), layout="constrained")
for row, (name, table) in enumerate([("random", hand.pos_embed[0]), ("trained", trained.pos_embed[0])]):
    sim = position_similarity(table)
    for col, patch in enumerate(range(0, 49, 8)):  # the patches on the diagonal of the 7 x 7 grid
        ax = axes[row, col]
        ax.imshow(rearrange(sim[patch], "(h w) -> h w", h=7), cmap="RdBu_r", vmin=-1, vmax=1)
        ax.plot(patch % 7, patch // 7, "k+", ms=8)
        ax.set_xticks([])
        ax.set_yticks([])
        if col == 0:
            ax.set_ylabel(name, fontsize=9)
    near, far = neighbours_vs_far(sim)
    print(f"{name:>8} positions: mean similarity of neighbours {near:+.2f}, of patches 4 or more apart {far:+.2f}")
fig.suptitle("Cosine similarity of one patch's (+) position vector to every other's")
display(fig)
plt.close(fig)
random_near, random_far = neighbours_vs_far(position_similarity(hand.pos_embed[0]))
trained_near, trained_far = neighbours_vs_far(position_similarity(trained.pos_embed[0]))
assert trained_near - trained_far > 0.2 > abs(random_near - random_far)  # learned: neighbours alike

# %% [markdown]
# The random table has no idea of the grid; the trained one has made neighbouring patches' vectors
# alike, which is the 2-D structure a convolution would have had from the start (the ViT paper's
# Figure 7, centre, shows the same for ViT-L/32 on ImageNet).

# %% [markdown]
# ## A small ViT on Fashion-MNIST
#
# Now train one. `create_model` builds a preset and takes any field of its `ViTConfig` as an
# override; this is the model built by hand above: 4 × 4 patches (a 7 × 7 grid, 49 tokens), a
# class token, learned positions, 4 blocks of 4 heads at width 32.
# `kernels=True` swaps in vitscope's CPU kernels for speed; the maths, and the attention
# `vitscope.inspect` captures, stay the same.
#
# The training loop is plain PyTorch: AdamW with a one-cycle learning-rate schedule, for 300 steps
# of 128 images, about two thirds of the 60,000 training images, each seen once. vitscope's own loop
# (`vitscope train`) adds mixed precision, augmentation, checkpoints and the rest; here the point is
# the model.

# %%
model = create_model("vit_tiny_patch4_28", embed_dim=D, depth=DEPTH, num_heads=HEADS, mlp_ratio=MLP_RATIO,
                     kernels=True)
print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hand.parameters())

STEPS, BATCH = 300, 128  # 38,400 images: about two thirds of one pass over the training split
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=STEPS, pct_start=0.1)
order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0))

model.train()
start = time.perf_counter()
for step in range(STEPS):
    batch = order[step * BATCH:(step + 1) * BATCH]
    loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    schedule.step()
seconds = time.perf_counter() - start
model.eval()

test_loss, accuracy = evaluate(model, (x_test, y_test), batch_size=1000)
print(f"{STEPS} steps in {seconds:.0f} s; test accuracy {accuracy:.2%} (loss {test_loss:.3f})")

# %% [markdown]
# Well past chance (10%) after less than one pass over the data, though short of what longer
# training reaches: the 10-epoch model later in this tutorial has the same architecture,
# trained longer with another recipe (see there).
# The floor below leaves room for another CPU's rounding.

# %%
assert accuracy > 0.70

# %% [markdown]
# ## Capturing the attention, and attention rollout
#
# `capture_attention` runs the model and returns every layer's attention weights, (B, H, N, N)
# with N = 1 + 49 tokens, plus the token layout (one prefix token, then a 7 × 7 grid of 4-pixel
# patches). Nothing in the model's code changes to allow it.

# %%
images = x_test[:500]
capture = capture_attention(model, images)
print(len(capture), "layers:", capture.names)
print("weights of layer 0:", tuple(capture[0].shape), "layout:", capture.layout)
assert torch.allclose(capture.output, model(images), atol=1e-4)  # capturing does not change the output

# %% [markdown]
# The first picture of where the model looks is the last layer's class-token row, averaged over
# the heads. It leaves out everything before: the tokens that the last layer's class token reads
# are already mixtures of patches made by the layers below. **Attention rollout** (Abnar & Zuidema,
# 2020, "Quantifying attention flow in transformers") follows the mixing back to the input. For
# each layer ℓ, average the heads' weights into one matrix Āₗ; add the identity, because the
# residual connection passes each token on to itself beside what attention adds; renormalise each
# row to sum to 1:
#
# Âₗ = rownorm(Āₗ + I),   R = Â_L · … · Â₂ · Â₁.
#
# Row i of R estimates how much output token i draws on each input token, treating every layer as
# a linear mixing of tokens (it ignores the MLPs and the values, so it is a heuristic, not an exact
# attribution). The class token's row of R, over the patches, is the rollout map. We compute it by
# hand and check it against `vitscope.inspect.rollout`:

# %%
R = torch.eye(capture.layout.num_tokens)
for weights in capture.layers():                                   # first layer to last, each (B, H, N, N)
    a = weights.mean(dim=1) + torch.eye(weights.shape[-1])         # (B, N, N): heads averaged, + residual
    R = (a / a.sum(dim=-1, keepdim=True)) @ R                      # renormalise the rows, then compose
by_hand_map = rearrange(R[:, 0, 1:], "b (h w) -> b h w", h=7)      # the class token's row, over the patches
vitscope_map = rollout_map(rollout(capture.layers(), num_prefix_tokens=1), capture.layout)
assert torch.allclose(by_hand_map, vitscope_map, atol=1e-5)
print("rollout maps", tuple(vitscope_map.shape), "match the hand computation")

# vitscope's plots return matplotlib figures: a notebook shows them; a `path` would also save them
display(plot_overlays(test.images[:4], capture, predictions=capture.output.argmax(-1), labels=y_test[:4],
                      class_names=test.classes, max_images=4))

# %% [markdown]
# Every head of every layer, for the first image: the class token's attention over the patches.

# %%
display(plot_heads_grid(test.images[0], capture))

# %% [markdown]
# ## The four regions of the attention matrix
#
# With a class token first, each layer's N × N matrix falls into four blocks:
#
# |  | key: CLS | keys: patches |
# |---|---|---|
# | **query: CLS** | CLS → CLS | CLS → patches |
# | **queries: patches** | patches → CLS | patches → patches |
#
# Each row sums to 1, so the two blocks of a row share its attention. `head_stats` measures the
# share of every block per layer and head; we compute the same by slicing, to see what it means.

# %%
stats = head_stats(capture)
layout = capture.layout
by_hand = torch.stack([
    torch.stack([w[:, :, :1, :1].sum(-1).mean((0, 2)),   # CLS -> CLS
                 w[:, :, :1, 1:].sum(-1).mean((0, 2)),   # CLS -> patches
                 w[:, :, 1:, :1].sum(-1).mean((0, 2)),   # patches -> CLS
                 w[:, :, 1:, 1:].sum(-1).mean((0, 2))], -1)  # patches -> patches: (H, 4)
    for w in capture.layers()]).numpy()                  # (L, H, 4)
assert np.allclose(stats.regions, by_hand, atol=1e-5)

print(f"share of attention per layer (mean over heads); uniform attention gives 1/{layout.num_tokens} = "
      f"{1 / layout.num_tokens:.3f} to the CLS token")
print(f"{'layer':>5} " + " ".join(f"{r:>12}" for r in REGIONS))
for layer in range(len(capture)):
    print(f"{layer:>5} " + " ".join(f"{stats.regions[layer, :, i].mean():>12.3f}" for i in range(4)))

display(plot_regions(stats))

# %% [markdown]
# ## Mean attention distance
#
# How far does a head look? The ViT paper's Figure 7 (right) answers with the **mean attention
# distance**: for each query patch, the distance in pixels to every other patch, weighted by the
# attention it gets, averaged over queries and images. A head that attends uniformly over the
# 7 × 7 grid scores the dashed line below; a head that looks only at its own patch scores 0.
#
# One choice has to be made that the paper's description leaves to the reader: the class token has no
# place in the image, so it has no distance. vitscope leaves it out, as a query and as a key, and
# **renormalises each patch row over the patches** before weighting: the number describes where a head
# looks *among the patches*. The other reading, which the paper's words allow and several
# reimplementations take, weights with the attention weights as they are, without renormalising. The two
# agree when the patches get nearly all of a row, and part when a head sends much of it to the class
# token: a head giving 95% of a row to the class token is judged here by where its leftover 5% goes, while
# the raw weights would shrink its distance towards 0 whatever the 5% did, which makes a head that only
# reads the class token look local. Below we compute both by hand, next to the share of each layer's patch
# rows that goes to the class token.

# %%
dist = patch_distances(layout)                                    # (N, N) pixels between patch centres
a = capture[0][:, :, 1:, 1:].double()                             # layer 0, patch rows and columns
renormalised = (a / a.sum(-1, keepdim=True) * dist).sum(-1).mean((0, 2))  # (H,)
assert np.allclose(stats.distance[0], renormalised.numpy(), atol=1e-4)

print(f"uniform attention over the patches: {uniform_distance(layout):.1f} px")
print(f"{'layer':>5}  {'to CLS':>6}  {'renormalised (vitscope)':>26}  {'raw weights':>26}")
for layer in range(len(capture)):
    w = capture[layer][:, :, 1:, 1:].double()
    raw = (w * dist).sum(-1).mean((0, 2))
    to_cls = stats.region("patch_cls")[layer].mean()
    print(f"{layer:>5}  {to_cls:>6.1%}  " + " ".join(f"{d:5.1f}" for d in stats.distance[layer])
          + "     " + " ".join(f"{d:5.1f}" for d in raw.numpy()) + "  px")
display(plot_distance(stats))

# %% [markdown]
# ## Which heads matter?
#
# Remove one head at a time (vitscope zeroes its output before the output projection, through
# `MultiHeadAttention.head_mask`) and measure what the model loses on 1,000 test images. Then
# remove heads cumulatively, least important first: the pruning curve.

# %%
subset = (x_test[:1000], y_test[:1000])
importance = ablation_importance(model, subset, batch_size=500)
print(f"accuracy with every head: {importance.base_accuracy:.2%}")
print("accuracy change when one head is removed, points (rows: layers, columns: heads)")
print(np.array2string(importance.delta_accuracy * 100, precision=1, suppress_small=True))
display(plot_importance(importance))

curve = pruning_curve(model, subset, importance, steps=8, batch_size=500)
display(plot_pruning({"by ablation": curve}))
for removed, acc in zip(curve.removed, curve.accuracy):
    print(f"{removed:>2} heads removed: {acc:.2%}")

# %% [markdown]
# Removing every head leaves the class token blind: its attention was its only way to see the
# patches, so it carries the same vector for every image and the model predicts one class for all
# of them. The test set holds 1,000 images of each class, so that must score exactly 10%.

# %%
modules = [m for _, m in attention_modules(model)]
for m in modules:
    m.head_mask = torch.zeros(m.num_heads)
_, blind = evaluate(model, (x_test, y_test), batch_size=1000)
for m in modules:
    m.head_mask = None
print(f"no heads at all: {blind:.2%}")
assert blind == 0.1
assert evaluate(model, subset, batch_size=500)[1] == importance.base_accuracy  # the masks are gone again

# %% [markdown]
# ## The notebook's questions, answered with numbers
#
# The next cell writes the answers from this run; rerun it and the text follows the numbers.

# %%
regions = stats.regions.mean(1)  # (L, 4): mean over heads
drop = -importance.delta_accuracy * 100  # points lost, per head
most = np.unravel_index(drop.argmax(), drop.shape)
harmless = int((drop < 0.5).sum())
half = next(acc for removed, acc in zip(curve.removed, curve.accuracy) if removed >= drop.size // 2)
uniform = uniform_distance(layout)
near_uniform = float(np.abs(stats.distance - uniform).max())
assert drop.max() > 0  # some head matters
assert half > 0.5 * importance.base_accuracy  # half of the heads keep more than half of the accuracy
display(Markdown(f"""
- **Which regions carry the attention?** Uniform attention over the {layout.num_tokens} tokens would give
  the class token {1 / layout.num_tokens:.0%} of every row and the patches the rest. Here, per layer
  (first to last, mean over heads), the class token's row gives the patches
  {", ".join(f"{r:.0%}" for r in regions[:, 1])}, and the patch rows give the patches
  {", ".join(f"{r:.0%}" for r in regions[:, 3])}.
- **How far do heads look?** From {stats.distance.min():.1f} to {stats.distance.max():.1f} px per head
  (per layer: {", ".join(f"{d:.1f}" for d in stats.distance.mean(1))} px), against {uniform:.1f} px for
  uniform attention: no head is more than {near_uniform:.1f} px from uniform.
- **Which heads matter?** Removing one head costs at most {drop.max():.1f} points (layer {most[0]}, head
  {most[1]}); {harmless} of the {drop.size} heads cost less than half a point each. Removing the
  {drop.size // 2} least important together leaves {half:.1%} (from {importance.base_accuracy:.1%});
  removing all of them leaves {blind:.0%}: without attention the class token never sees the image.

After {STEPS} steps the heads' mean distances are within {near_uniform:.1f} px of uniform attention's,
yet the model has learned something, and it lives in the departures from uniform, which depend on the
image and on the query and which averages over 500 images and 49 queries hide; the per-image maps above
show them. Does longer training change the averages? The next section loads this architecture trained
for 10 epochs.
"""))

# %% [markdown]
# ## The same architecture after 10 epochs
#
# The checkpoint loaded above (`checkpoints/vit_fmnist_10ep.safetensors` beside this tutorial,
# 0.15 MB) is this tutorial's architecture, trained by vitscope's loop with the recipe of the `fmnist_tutorial`
# preset (Adam at a constant learning rate of 10⁻³, no weight decay, no augmentation), seed 0, for 10 epochs
# where the preset trains 20. That is not the recipe of the 300 steps above (AdamW with weight decay 0.05
# and a one-cycle schedule up to 3·10⁻³), so the differences below come from the recipe as well as
# from the length. It took 20 minutes on one thread of a busy 2-core Zen 3. It was made by
#
# ```
# vitscope train --preset fmnist_tutorial --set depth=4 --set num_heads=4 --set mlp_ratio=2 \
#     --epochs 10 --threads 1 --seed 0 --explain-images 0 --out runs/t2_10ep
# cp runs/t2_10ep/last.safetensors docs/tutorials/checkpoints/vit_fmnist_10ep.safetensors
# ```
#
# (the preset's own model has the same width, is deeper and has a narrower MLP: 6 blocks of 2 heads,
# MLP ratio 1; trained for its 20 epochs it reached 87.6%, benchmarks/RESULTS.md). That recipe is a
# plain ViT trained the way teaching notebooks train one. The README's `fmnist_quick` preset, a
# hybrid whose conv stem makes the 7 × 7 tokens, reaches about 93.7%, but that figure is not this
# model's plus a stem: it is also wider (128), trained with Muon, label smoothing and flips, and
# scores each test image averaged with its mirror (its docstring in `vitscope.training.recipes`).
# A stem builds in the locality that the plain ViT has to learn; how much of the gap it makes, that
# comparison does not say.

# %%
trained_loss, trained_accuracy = evaluate(trained, (x_test, y_test), batch_size=1000)
print(f"10 epochs: test accuracy {trained_accuracy:.2%} (loss {trained_loss:.3f}); 300 steps: {accuracy:.2%}")
assert trained_accuracy > accuracy

trained_capture = capture_attention(trained, images)
trained_stats = head_stats(trained_capture)
uniform_entropy = float(np.log(layout.num_tokens))  # ln 50 nats: a row that spreads evenly
print(f"uniform attention: {uniform:.1f} px, entropy {uniform_entropy:.2f} nats")
print(f"{'':>8}  {'mean distance per head, px':>26}  {'entropy per head, nats':>23}  largest weight of a patch row")
for layer in range(len(trained_capture)):
    largest = trained_capture[layer][:, :, 1:].amax(-1).mean((0, 2))  # (H,): mean over images and queries
    print(f"layer {layer}:  " + " ".join(f"{d:5.1f}" for d in trained_stats.distance[layer]) + "  "
          + " ".join(f"{e:5.2f}" for e in trained_stats.entropy[layer]) + "     "
          + " ".join(f"{w:5.2f}" for w in largest.numpy()))
print("300 steps, entropy per layer:", ", ".join(f"{e:.2f}" for e in stats.entropy.mean(1)),
      "; 10 epochs:", ", ".join(f"{e:.2f}" for e in trained_stats.entropy.mean(1)))
display(plot_distance(trained_stats))

# %%
farthest = float(np.abs(trained_stats.distance - uniform).max())
deep_entropy = float(trained_stats.entropy[1:].mean())
assert deep_entropy < uniform_entropy - 0.3   # the heads above the first are selective...
assert farthest < 2.0                          # ...but no head is local: all within 2 px of uniform
display(Markdown(f"""
After 10 epochs the model is right on {trained_accuracy:.1%} of the test images, and its attention has
changed: above the first layer the heads' rows have an entropy of {deep_entropy:.2f} nats on average,
against {uniform_entropy:.2f} for a row spread evenly over the 50 tokens, so each patch picks out some
tokens and ignores others. Yet by distance nothing has changed: every head's mean attention distance
is within {farthest:.1f} px of the {uniform:.1f} px of uniform attention. The heads choose *what* to
look at, by content, not *how far*.

This is not the ViT paper's picture. Its Figure 7 (right), for ViT-L/16, shows in the lowest layers
some heads that look far and some whose mean distance is small, local like a convolution's, and
distances that grow with depth until every head looks far. That model saw 224 × 224 images as 196
tokens and was trained on far more data; ours sees 28 × 28 images as 49 tokens of 4 × 4 pixels
each, and after 10 epochs on 60,000 of them its heads have not become local.
"""))

# %% [markdown]
# We tried to make them local, a change or a few per run. `benchmarks/locality_study.py` trains each run
# (the command that made the checkpoint with one change; exercise 6 reruns one) and writes, from each
# run's probes, every head's mean distance at its last evaluation and the run's test accuracy to
# `checkpoints/locality_study.json` beside this tutorial (runs on a Zen 3, seed 0; the patch-2 and
# the wide runs were stopped early, at the epochs given). The table is built from that file.

# %%
CHANGES = {
    "patch2": "patches of 2 × 2 pixels: 196 tokens, as many as ViT-B/16 has at 224",
    "patch2_sc": "the same with fixed `sincos2d` positions",
    "augment": "random crops (padding 2) and flips, as the `fmnist_best` preset's",
    "wide": "twice as wide, `sincos2d` positions, crops and flips",
    "cutmix": "CutMix on every batch, crops and flips",
    "pixels": "tokens of one pixel (scikit-learn's 8 × 8 digits, 64 tokens)",
}
study_file = next(c / "locality_study.json" for c in candidates if (c / "locality_study.json").exists())
study = json.loads(study_file.read_text())
lines = ["| change to this model | epochs | test accuracy | heads' mean distance (uniform) |", "|---|---|---|---|"]
kept = {}  # each run's nearest head, as a fraction of uniform attention's distance
for name, change in CHANGES.items():
    run = study[name]
    d = np.array(run["distance"])  # (layers, heads) at the run's last evaluation
    kept[name] = d.min() / run["uniform"]
    lines.append(f"| {change} | {run['epoch']} | {run['test_acc']:.1%} | {d.min():.1f}-{d.max():.1f} px "
                 f"({run['uniform']:.1f}) |")
nearest = min(kept.values())
assert nearest > 0.5  # no head of any run is local: each keeps more than half of the uniform distance
display(Markdown("\n".join(lines) + f"""

In every run the nearest head kept at least {nearest:.1%} of the distance of uniform attention, where a
local head keeps a small fraction of it. Even a token of one pixel, which alone cannot see a stroke, did
not make its heads gather their neighbours: that model reached {study['pixels']['test_acc']:.1%} choosing
tokens by content, near or far. Raghu et al. (2021, "Do Vision Transformers See Like Convolutional Neural
Networks?") report that large-scale pre-training data helps a ViT's lowest layers learn to attend
locally. The ViT paper's models were pre-trained on up to 300 million images; on Fashion-MNIST, at these
budgets, the heads choose by content.
"""))

# %% [markdown]
# ## Heads that do become local: hide patches and ask for them back
#
# Labels never asked these heads to look nearby: a garment's class can be read from its outline,
# gathered from anywhere. The ViT paper tried a second task as well (its section 4.6, "masked patch
# prediction", after BERT's masked words): hide some of the patches and have the model paint them
# back. A hidden patch's pixels are best guessed from the patches around it, so here a head that
# gathers each token's neighbours pays. The paper corrupted half of the patches and predicted each
# one's mean colour; we use the simpler form SimMIM (Xie et al. 2022) gave the task: hidden patches
# replaced by a mask token, their pixels predicted by a linear layer.
#
# `benchmarks/locality_mim.py` trains a ViT like this tutorial's (4 blocks of 4 heads, MLP ratio 2,
# patches of 4 × 4 pixels), twice as wide (64) and with the fixed 2-D sine-cosine positions
# (`pos_embed="sincos2d"`: the table need not be learned first), in two stages:
#
# 1. **masked patch prediction**: each patch is hidden with probability 0.3 (about 15 of the 49): their
#    embeddings are replaced by one learned *mask token*, their positions kept. A linear layer on the
#    last block's tokens predicts each hidden patch's 16 pixels (L1 loss, on the hidden patches only);
#    4,000 steps of 128 images;
# 2. **fine-tuning**: the same ViT with a new head, all of it trained on the labels for 2,000 steps.
#
# It saved the ViT after each stage (0.55 MB each, beside this tutorial) and every head's mean
# distance every 500 steps, which the next cell reads back; the command and the time are in the files.

# %%
MIM_FILES = {"masked patch prediction": "vit_fmnist_mim.safetensors",
             "fine-tuned on labels": "vit_fmnist_mim_ft.safetensors"}
mim_dir = next(c for c in candidates if all((c / f).exists() for f in MIM_FILES.values()))
mim_history = json.loads((mim_dir / "locality_mim.json").read_text())
print("made by:", mim_history["command"])
print(f"masked patch prediction {mim_history['mim_seconds'] / 60:.0f} min, fine-tuning "
      f"{mim_history['finetune_seconds'] / 60:.0f} min, test accuracy {mim_history['test_acc']:.1%}")
mim_stats = {}
for stage, name in MIM_FILES.items():
    mim_model = load_model(mim_dir / name)
    mim_stats[stage] = head_stats(capture_attention(mim_model, images))  # the same 500 test images as above
    print(f"{stage}: mean distance per head, px (uniform {uniform:.1f})")
    for layer, row in enumerate(mim_stats[stage].distance):
        print(f"  layer {layer}: " + " ".join(f"{d:5.1f}" for d in row))
mim_accuracy = evaluate(mim_model, (x_test, y_test), batch_size=1000)[1]  # the fine-tuned model
print(f"fine-tuned model: test accuracy {mim_accuracy:.2%}")

# %% [markdown]
# Each stage's distances as the ViT paper's Figure 7 draws them, one dot per head, and how the heads
# of each layer moved during the masked patch prediction and the fine-tuning (the mean over each
# layer's heads, and its nearest head):

# %%
def stages_figure(stats: dict, history: dict):
    """Each stage's heads as dots per layer (the ViT paper's Figure 7), and every layer's mean and nearest head
    over the run's readings, pre-training then fine-tuning."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), layout="constrained")
    head_colors = plt.get_cmap("tab10")
    for ax, (stage, st) in zip(axes[:2], stats.items()):
        layers, heads = st.distance.shape
        for h in range(heads):
            ax.scatter(np.arange(layers) + (h - 1.5) * 0.08, st.distance[:, h], color=head_colors(h), s=25,
                       edgecolors="k", linewidths=0.4, label=f"head {h}")
        ax.axhline(uniform, ls="--", c="gray", lw=1, label="uniform")
        ax.set(title=stage, xlabel="layer", ylabel="mean attention distance (px)", ylim=(0, 1.15 * uniform),
               xticks=range(layers))
    axes[0].legend(fontsize=7, loc="lower left")
    readings = history["readings"]
    pre_steps = max(r["step"] for r in readings if r["stage"] == "mim")
    steps = [r["step"] + (pre_steps if r["stage"] == "finetune" else 0) for r in readings]
    for layer in range(len(readings[0]["distance"])):
        mean = [np.mean(r["distance"][layer]) for r in readings]
        nearest_head = [np.min(r["distance"][layer]) for r in readings]
        axes[2].plot(steps, mean, color=head_colors(layer), label=f"layer {layer}: mean of heads")
        axes[2].plot(steps, nearest_head, color=head_colors(layer), ls=":", label=f"layer {layer}: nearest head")
    axes[2].axhline(uniform, ls="--", c="gray", lw=1)
    axes[2].axvline(pre_steps, c="k", lw=0.8)
    axes[2].text(pre_steps, 1.04 * uniform, " fine-tuning →", fontsize=8)
    axes[2].set(title="during training", xlabel="step", ylabel="mean attention distance (px)",
                ylim=(0, 1.15 * uniform))
    axes[2].legend(fontsize=6, ncol=2, loc="lower left")
    return fig


fig = stages_figure(mim_stats, mim_history)
display(fig)
plt.close(fig)

# %%
after_mim, after_ft = (mim_stats[s].distance for s in MIM_FILES)
nearest_mim = after_mim.min() / uniform                 # the most local head, as a share of uniform's distance
nearest_layer = int(after_mim.min(1).argmin())
first_layer_nearest = after_mim[0].min() / uniform
nearest_ft = after_ft[1:-1].min() / uniform             # the middle layers' most local head after fine-tuning
top_mim, top_ft = after_mim[-1].mean(), after_ft[-1].mean()
assert nearest_mim < 0.5 * nearest                      # far more local than any head of the table above
assert nearest_layer > 0 and first_layer_nearest > 0.75  # the local heads sit above the first layer...
assert nearest_ft < 0.8 and top_ft > top_mim + 1.0      # ...some stay after fine-tuning; the top layer widens
start = np.array(mim_history["readings"][0]["distance"])  # (layers, heads) before the first step
assert np.abs(start - uniform).max() < 0.2              # learned: every head starts at the uniform distance
display(Markdown(f"""
After the masked patch prediction the heads are local: the nearest looks {after_mim.min():.1f} px away on
average, {nearest_mim:.0%} of uniform attention's {uniform:.1f} px, where every head of every run in the
table above kept at least {nearest:.0%}. They learned it: before the first step every head is within
{np.abs(start - uniform).max():.2f} px of the uniform distance. The sine-cosine table makes nearby positions
alike, which makes a local head easy to express, but labels did not make the heads use it: the table's
`wide` run also has these positions and this width (with crops, flips and its own recipe), and its nearest
head kept {kept["wide"]:.0%}; `--mim-steps 0` (exercise 7) is the exact control. Fine-tuned on the labels (test
accuracy {mim_accuracy:.1%}), the top layer's heads widen again, from {top_mim:.1f} to {top_ft:.1f} px
on average, while the middle layers keep a head at {nearest_ft:.0%} of the uniform distance.

It is not the ViT paper's picture either. There the lowest layers hold the local heads and the highest
look far; here the most local head sits in layer {nearest_layer}, and the first layer's heads stay
near uniform (its nearest at {first_layer_nearest:.0%}). Xie et al. (2023, "Revealing the Dark Secrets
of Masked Image Modeling") compare the two kinds of training on large ViTs: supervised models attend
locally in the lower layers and globally in the higher ones, and masked image modelling brings local
heads to all layers. Our small model gets them above its first layer only; exercise 7 reruns it with
other patches and positions, and the next section gives the first layer a reason to look nearby.
"""))

# %% [markdown]
# ## Noise on every patch: the layers ordered from near to far
#
# Why might hiding leave the first layer near uniform? Only the hidden tokens need their neighbours, and
# the distances are measured on whole images, where nothing is hidden: there the first layer's tokens are
# the patches themselves, each already holding its own pixels. A task in which *every* token needs its
# neighbours gives the first layer a reason to look nearby: add noise to every pixel and ask for all the
# clean patches back, the hidden ones painted, the visible ones cleaned (the denoising autoencoder's
# objective, Vincent et al. 2008: rebuild the clean input from a corrupted one). A noisy patch is best
# cleaned with the help of the patches around it, which carry the same strokes.
#
# `python benchmarks/locality_mim.py --noise 2.0 --out runs/locality_denoise` runs the same two stages
# as above with Gaussian noise of standard deviation 2 (in the normalised pixels' units: twice the
# pixels' own spread) on every input pixel during the first stage and the loss over every patch; the
# fine-tuning sees clean images. Its two ViTs and its history are beside this tutorial too.

# %%
DENOISE_FILES = {"noisy and hidden patches": "vit_fmnist_denoise.safetensors",
                 "fine-tuned on labels": "vit_fmnist_denoise_ft.safetensors"}
denoise_history = json.loads((mim_dir / "locality_denoise.json").read_text())
print("made by:", denoise_history["command"])
denoise_stats = {}
for stage, name in DENOISE_FILES.items():
    denoise_model = load_model(mim_dir / name)
    denoise_stats[stage] = head_stats(capture_attention(denoise_model, images))  # the same 500 test images
    print(f"{stage}: mean distance per head, px (uniform {uniform:.1f})")
    for layer, row in enumerate(denoise_stats[stage].distance):
        print(f"  layer {layer}: " + " ".join(f"{d:5.1f}" for d in row))
denoise_accuracy = evaluate(denoise_model, (x_test, y_test), batch_size=1000)[1]  # the fine-tuned model
print(f"fine-tuned model: test accuracy {denoise_accuracy:.2%}")
fig = stages_figure(denoise_stats, denoise_history)
display(fig)
plt.close(fig)

# %%
tuned = denoise_stats["fine-tuned on labels"].distance  # (layers, heads), px
layer_mean, layer_nearest = tuned.mean(1), tuned.min(1)
denoise_start = np.array(denoise_history["readings"][0]["distance"])
assert np.abs(denoise_start - uniform).max() < 0.2       # learned: every head starts at the uniform distance
assert int(layer_nearest.argmin()) == 0                   # the nearest head is in the first layer,
assert layer_nearest[0] < after_ft[0].min() - 1.0          # nearer than hiding alone made it,
assert np.all(np.diff(layer_mean) > 0) and np.all(np.diff(layer_nearest) > 0)  # ...and each layer looks farther
assert layer_nearest[0] < 0.8 * uniform and layer_mean[-1] > 0.95 * uniform  # from below uniform up to it
display(Markdown(f"""
After fine-tuning on the labels (test accuracy {denoise_accuracy:.1%}) the order is the ViT paper's: the
nearest head is in the first layer, at {layer_nearest[0]:.1f} px ({layer_nearest[0] / uniform:.0%} of
uniform attention's {uniform:.1f} px, where hiding alone left the first layer's nearest at
{after_ft[0].min():.1f} px), and each layer looks farther than the one below it: the layers' mean distances
are {", ".join(f"{d:.1f}" for d in layer_mean)} px from the first to the last, their nearest heads
{", ".join(f"{d:.1f}" for d in layer_nearest)} px, and the last layer's heads look about as far as uniform
attention. Some steps are small ({np.diff(layer_mean).min():.1f} px between two layers' means), and before
the fine-tuning the middle layers were not yet in order (the left panel). As with hiding alone, every head
started at the uniform distance.

The locality is mild, though: the first layer's nearest head looks {layer_nearest[0] / uniform:.0%} as far
as uniform attention, where ViT-L/16's most local heads in Figure 7 look a small fraction as far as its
farthest, and hiding alone made one head of layer {nearest_layer} look {after_mim.min() / uniform:.0%} as far.
Much of the order comes from the upper layers staying wide, where hiding made them local. Between them the
two pre-trainings show two halves of the paper's picture on a model this small, and neither the whole: hiding
makes heads sharply local, but above the first layer; noise orders the layers from near to far, but its
nearest heads are only mildly local. Exercise 8 varies the noise.
"""))

# %%
display(plot_overlays(test.images[:4], trained_capture, predictions=trained_capture.output.argmax(-1),
                      labels=y_test[:4], class_names=test.classes, max_images=4))

# %% [markdown]
# To see all of this for any trained run, one command writes these pictures and an interactive
# page where you hover over the patches: `vitscope explain RUN --dataset fashion_mnist --out explain/`.

# %%
print(f"this run of the tutorial took {(time.perf_counter() - tutorial_start) / 60:.1f} minutes")

# %% [markdown]
# ## Exercises
#
# Each is a change to a cell above (rerun from that cell on) or a command to run.
#
# 1. **Average pooling.** Train the small ViT with `class_token=False, global_pool="avg"` added to
#    `create_model`. Compare the accuracy after 300 steps, and the maps of `plot_overlays`, which
#    now show the mean of the patch rows, as there is no class token.
# 2. **No positions.** Build `HandViT` without `pos_embed` (drop the `+ self.pos_embed`), shuffle the
#    49 patches of an image (cut them with einops, permute them, put them back with the reverse
#    pattern), and check that the logits do not change.
#    Then train `create_model(..., pos_embed="none")` for 300 steps: how much accuracy do positions buy
#    on Fashion-MNIST?
# 3. **Bigger patches.** Use `create_model("vit_tiny_patch7_28", ...)`: 16 tokens of 7 × 7 pixels.
#    How do the time per step, the accuracy and the uniform mean distance change?
# 4. **Rollout variants.** `rollout(capture.layers(), num_prefix_tokens=1, head_fusion="max")`, or with
#    `discard_ratio=0.9`, keeps only each layer's strongest paths. Draw the maps with
#    `vitscope.inspect.plots.overlay` and compare them with the mean-of-heads rollout.
# 5. **The raw distance.** Plot the raw-weight mean distance of the 300-step model and of the trained one
#    next to vitscope's. For which heads do they differ most, and how much of those heads' rows goes to
#    the class token?
# 6. **Local heads?** `python benchmarks/locality_study.py augment` (or `patch2`, `wide`, `cutmix`,
#    `pixels`) reruns one row of the table above: the command that made the checkpoint with that row's change
#    and epochs, printed as it starts (the patch-2 and wide rows were stopped early, so their reruns train
#    for longer than the table's rows did). A run keeps each head's mean distance at every evaluation:
#    `read_probes("runs/locality/augment").distance(step)` gives it as (layers, heads), and the run's
#    explorer.html has a slider over the steps. Try a change of your own: more epochs, a learning-rate
#    decay, `--aug-erase-p 0.25`. Do heads with a small mean distance appear in the first layers, as in
#    the ViT paper?
# 7. **Masked patches.** `python benchmarks/locality_mim.py --out runs/mim_learn --pos-embed learn`
#    reruns the hiding section's model with learned positions (30-40 minutes on one core); `--patch 2`
#    cuts 196 tokens of 2 × 2 pixels, `--mask-ratio 0.6` hides more, `--mim-steps 0` trains on the
#    labels alone. Each run prints every layer's mean distance every 500 steps and writes them to its
#    `history.json`. Which change makes the first layer's heads local?
# 8. **Noise.** Rerun the last section's model with `--noise 1.0` and with `--noise 3.0` (add
#    `--out runs/noise1` and so on). How does the first layer's nearest head move, and does each layer
#    still look farther than the one below it? With `--mask-ratio 0 --noise 2.0` nothing is hidden: is
#    cleaning alone enough?

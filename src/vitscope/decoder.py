"""The Transformer decoder, read top to bottom: pre-norm block, then the stack.

Tokens are (B, T) int64; the encoder's output `context` is (B, M, Dc). Padding masks follow
torch.nn.MultiheadAttention's `key_padding_mask`: (B, N) bool, True marks a pad position.
Decoding step by step reuses keys and values through one (self, cross) pair of `KVCache` per
block, and gives the same logits as running the whole prefix again.

Beam search decodes G hypotheses of one image: token rows (B·G, T) against a context of B rows.
Cross-attention treats each query on its own (no mask between queries), so the G rows' queries are
read as G·T queries of their image's one context row: (B·G, T, D) -> (B, G·T, D). The context, its
keys and values and their cache stay at one row per image, never copied per hypothesis.

`TransformerDecoder._step` is that block once more for the one call decoding repeats, one new token per row
after the caches are filled, in the few ops it needs; its linear layers, self- and cross-attention and MLP are
seams (`step_linears`, `step_self_attention`, `step_cross_attention`, `step_mlp`) that vitscope.kernels' decoder
overrides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from einops import rearrange
from torch import Tensor, nn

from vitscope.attention import KVCache, MultiHeadAttention, attend, key_padding_mask
from vitscope.positional import LearnedPositionalEmbedding
from vitscope.vit import Mlp

# One (self-attention, cross-attention) cache per block.
Caches = list[tuple[KVCache, KVCache]]
# How a decoding step runs a linear layer: linear(x, layer) -> layer's output.
StepLinear = Callable[[Tensor, nn.Module], Tensor]


def keep_mask(padding_mask: Tensor | None) -> Tensor | None:
    """(B, N) True-at-padding -> (B, 1, 1, N) True-where-attending, the convention of `attend`."""
    return None if padding_mask is None else key_padding_mask(padded=padding_mask)


def context_rows(context: Tensor | None, caches: Caches | None, default: int) -> int:
    """How many rows the context has: its own, or its cached keys' once the context is not passed."""
    if context is not None:
        return context.shape[0]
    if caches and caches[0][1].k is not None:
        return caches[0][1].k.shape[0]
    return default


def own_forward(x: Tensor, layer: nn.Module) -> Tensor:
    """layer(x): a decoding step's linear layer run by its own forward (`TransformerDecoder.step_linears`)."""
    return layer(x)


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention, cross-attention over the context, MLP.

    x + self_attn(norm1(x)); x + cross_attn(norm2(x), context); x + mlp(norm3(x)).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        *,
        context_dim: int | None = None,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.self_attn = MultiHeadAttention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                                            proj_drop=drop, norm_eps=norm_eps)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.cross_attn = MultiHeadAttention(dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                                             proj_drop=drop, cross=True, context_dim=context_dim,
                                             norm_eps=norm_eps)
        self.norm3 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None,
        *,
        mask: Tensor | None = None,
        context_mask: Tensor | None = None,
        caches: tuple[KVCache, KVCache] | None = None,
        return_weights: bool = False,
        self_weights: bool = True,
        groups: int = 1,
    ):
        """x (B·G, T, dim), context (B, M, Dc) -> (B·G, T, dim), with G = `groups` rows of x per
        context row (1 unless beams share an image).

        `mask` (B·G, ...) and `context_mask` (B, ...) are `attend` masks (True = may look),
        broadcastable to (B·G, H, T, past + T) and (B, H, G·T, M). With `caches`, x holds only the
        new tokens and the context may be None once the cross cache is filled. With
        `return_weights` also returns the self- and cross-attention weights, (B·G, H, T, past + T)
        and (B·G, H, T, M); `self_weights=False` leaves the first out (None), so that attention
        need not be materialised.
        """
        self_cache, cross_cache = caches if caches is not None else (None, None)
        bg, t, d = x.shape
        # One new token sees every cached one: the causal mask would be all True.
        h = self.self_attn(self.norm1(x), mask=mask, causal=t > 1, cache=self_cache,
                           return_weights=return_weights and self_weights)
        h, self_w = h if return_weights and self_weights else (h, None)
        x = x + h
        queries = self.norm2(x).reshape(bg // groups, groups * t, d)  # (B, G·T, dim): an image's rows together
        h = self.cross_attn(queries, context, mask=context_mask, cache=cross_cache, return_weights=return_weights)
        h, cross_w = h if return_weights else (h, None)
        x = x + h.reshape(bg, t, d)
        if return_weights:
            cross_w = rearrange(cross_w, "b h (g t) m -> (b g) h t m", g=groups, t=t)
        x = x + self.mlp(self.norm3(x))
        return (x, self_w, cross_w) if return_weights else x


class TransformerDecoder(nn.Module):
    """Token embedding + learned positions -> decoder blocks -> LayerNorm -> logits over the vocabulary."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        num_heads: int,
        max_len: int,
        *,
        context_dim: int | None = None,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.vocab_size, self.max_len = vocab_size, max_len
        self.token_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = LearnedPositionalEmbedding(max_len, dim)
        self.drop = nn.Dropout(drop)
        self.blocks = nn.ModuleList([
            DecoderBlock(dim, num_heads, mlp_ratio, context_dim=context_dim, qkv_bias=qkv_bias,
                         drop=drop, attn_drop=attn_drop, norm_eps=norm_eps)
            for _ in range(depth)
        ])
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.head = nn.Linear(dim, vocab_size)
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 / timm style: truncated normal 0.02 for matrices and the token table, zero biases."""
        nn.init.trunc_normal_(self.token_embed.weight, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def new_caches(self) -> Caches:
        """Empty (self, cross) key/value caches, one pair per block, for step-by-step decoding."""
        return [(KVCache(), KVCache()) for _ in self.blocks]

    def forward(
        self,
        tokens: Tensor,
        context: Tensor | None,
        *,
        padding_mask: Tensor | None = None,
        context_padding_mask: Tensor | None = None,
        caches: Caches | None = None,
        return_weights: bool = False,
    ):
        """tokens (B, T) int64, context (B, M, Dc) -> logits (B, T, vocab_size).

        The context may have fewer rows than the tokens, Bc dividing B: then each context row serves
        B / Bc consecutive token rows (an image's beams), read by broadcasting.
        `padding_mask` (B, past + T) and `context_padding_mask` (Bc, M) are True at pad positions.
        With `caches` (from `new_caches`), `tokens` are only the new ones: their positions start
        at the number of tokens already cached. With `return_weights` also returns every block's
        cross-attention weights, (B, T, L, H, M): what each new token looked at in the context.
        """
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (B, T) token ids, got shape {tuple(tokens.shape)}")
        past = len(caches[0][0]) if caches else 0
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"got {len(caches)} caches for {len(self.blocks)} blocks; use new_caches()")
        if padding_mask is not None and padding_mask.shape[-1] != past + tokens.shape[1]:
            raise ValueError(f"padding_mask covers {padding_mask.shape[-1]} positions but there are "
                             f"{past} cached + {tokens.shape[1]} new tokens; pass it for all of them")
        rows = context_rows(context, caches, tokens.shape[0])
        if tokens.shape[0] % rows:
            raise ValueError(f"{tokens.shape[0]} token rows cannot share {rows} context rows evenly; give one "
                             f"context row per image and its beams' rows consecutively")
        mask, context_mask = keep_mask(padding_mask), keep_mask(context_padding_mask)
        x = self.drop(self.pos_embed(self.token_embed(tokens), offset=past))  # (B, T, D)
        cross = []
        for i, block in enumerate(self.blocks):
            x = block(x, context, mask=mask, context_mask=context_mask,
                      caches=caches[i] if caches is not None else None, return_weights=return_weights,
                      self_weights=False, groups=tokens.shape[0] // rows)
            if return_weights:
                x, _, w = x
                cross.append(w)  # (B, H, T, M)
        logits = self.head(self.norm(x))  # (B, T, V)
        if not return_weights:
            return logits
        return logits, torch.stack(cross, 2).transpose(1, 3)  # (B, H, L, T, M) -> (B, T, L, H, M)

    # -- one decoding step: what greedy decoding and beam search repeat --------------------------------------------
    def _step(self, tokens: Tensor, context_mask: Tensor | None, caches: Caches, return_weights: bool = False):
        """`forward(tokens, None, context_padding_mask=..., caches=caches, return_weights=...)` for one new token
        per row after the caches are filled, in inference: tokens (R, 1) -> logits (R, 1, V), and with
        `return_weights` every block's cross-attention (R, 1, L, H, N). The same numbers, bit for bit
        (tests/test_decoder.py), in the few ops a step needs: no checks (the caller has made forward's), no
        causal mask (one query sees every cached key), no dropout. `context_mask` is `keep_mask` of the context's
        padding mask, (B, 1, 1, N). vitscope.kernels' decoder takes its steps here, through the seams below."""
        r, past = tokens.shape[0], len(caches[0][0])
        b = caches[0][1].k.shape[0]
        g = r // b  # hypotheses per image
        x = self.token_embed(tokens) + self.pos_embed.weight[past:past + 1]  # (R, 1, D)
        linear = self.step_linears(x)
        cross = []
        for i, (block, (self_cache, cross_cache)) in enumerate(zip(self.blocks, caches)):
            sa, ca = block.self_attn, block.cross_attn
            # x + self_attn(norm1(x)): the new token's query against its row's cached keys and its own
            qkv = linear(block.norm1(x), sa.qkv).view(r, 1, 3, sa.num_heads, sa.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (R, H, 1, Dh) each
            k, v = self_cache.append(k, v)  # (R, H, past + 1, Dh)
            x = x + linear(self.step_self_attention(sa, q, k, v), sa.proj)
            # x + cross_attn(norm2(x), context): an image's G beams ask its one context row together
            q = linear(block.norm2(x).reshape(b, g, -1), ca.q)  # (B, G, H·Dh)
            q = q.view(b, g, ca.num_heads, ca.head_dim).transpose(1, 2)  # (B, H, G, Dh)
            out, w = self.step_cross_attention(i, ca, q, cross_cache, context_mask, return_weights)
            if return_weights:
                cross.append(w.transpose(1, 2))  # (B, G, H, N)
            x = x + linear(out, ca.proj).reshape(r, 1, -1)
            # x + mlp(norm3(x))
            x = x + self.step_mlp(block.mlp, block.norm3(x), linear)
        logits = linear(self.norm(x), self.head)  # (R, 1, V)
        if not return_weights:
            return logits
        return logits, torch.stack(cross, 2).reshape(r, 1, len(cross), *cross[0].shape[2:])  # (R, 1, L, H, N)

    # The step's three seams, which vitscope.kernels' decoder overrides (kernels/fast_decoder.py).
    def step_linears(self, x: Tensor) -> StepLinear:
        """How a step's linear layers run, chosen once per step from its first input x (R, 1, D): here each
        layer's own forward. A seam because one step runs ~6 small layers per block, and the kernels run them all
        through one product chosen once, with bfloat16 weights cast once and kept between steps."""
        return own_forward

    def step_self_attention(self, attn: MultiHeadAttention, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """A step's self-attention: each row's new query q (R, H, 1, Dh) over its cached keys and values and its
        own, k and v (R, H, past + 1, Dh) -> (R, 1, H·Dh) as `proj` reads it. A seam because the kernels take it
        in one pass over the cache (in float32)."""
        out = attend(q, k, v, scale=attn.scale)  # (R, H, 1, Dh)
        return out.transpose(1, 2).reshape(q.shape[0], 1, -1)

    def step_cross_attention(self, i: int, attn: MultiHeadAttention, q: Tensor, cache: KVCache,
                             context_mask: Tensor | None, return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Block i's cross-attention `attn` of a step's queries q (B, H, G, Dh) over the context's cached keys and
        values (B, H, N, Dh) -> (its output (B, G, H·Dh) as `proj` reads it, its weights (B, H, G, N) where
        `return_weights`, else None). A seam because the kernels take it from keys and values packed once per
        decoding, in bfloat16 with float32 scores."""
        out = attend(q, cache.k, cache.v, mask=context_mask, scale=attn.scale, return_weights=return_weights)
        out, w = out if return_weights else (out, None)
        b, h, g, d = out.shape
        return out.transpose(1, 2).reshape(b, g, h * d), w  # (B, H, G, Dh) -> (B, G, H·Dh)

    def step_mlp(self, mlp: Mlp, x: Tensor, linear: StepLinear) -> Tensor:
        """mlp(x) for a step's x (R, 1, D): here the module's own forward. A seam because the kernels run its two
        layers through the step's `linear` (`step_linears`), in bfloat16 with fc1's GELU inside its product."""
        return mlp(x)

"""Attention from first principles: the function `attend` and the modules built on it.

Shapes use fixed letters: B batch, H heads, Nq/Nk query/key length, D head width, C channels.

Masks follow `torch.nn.functional.scaled_dot_product_attention`: a boolean mask is True where a
query may look at a key; a float mask is added to the scores. `causal=True` aligns the last query
with the last key (query i sees keys j <= i + Nk - Nq), which equals the usual lower triangle when
Nq == Nk and is what incremental decoding with a key/value cache needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from vitscope.errors import ConfigError

# At or below this many keys, half-precision training runs the explicit path: PyTorch's fused CPU
# kernel is slower backwards in bfloat16 at ViT-sized sequences (bench_attention.py's crossover table;
# docs/performance.md). Above it the fused kernel runs, so the Nq x Nk matrix is never materialised.
EXPLICIT_HALF_MAX_KEYS = 512
# At or below this many queries per row, half-precision inference on CPU runs the explicit path too: decoding
# asks one query per row (a beam group a few), where PyTorch's fused CPU kernel took 1.5-5.7x the explicit
# path's time in bfloat16 at 20 and 196 keys (benchmarks/bench_decode_attention.py); at 32 queries it can win.
EXPLICIT_HALF_MAX_QUERIES = 16


def causal_mask(nq: int, nk: int, device: torch.device | None = None) -> Tensor:
    """(Nq, Nk) bool, True where query i may see key j: j <= i + Nk - Nq."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    return j <= i + (nk - nq)


def key_padding_mask(
    lengths: Tensor | None = None, *, padded: Tensor | None = None, n: int | None = None
) -> Tensor:
    """Mask (B, 1, 1, N) that is True at real keys, from `lengths` (B,) or `padded` (B, N).

    `padded` follows torch.nn.MultiheadAttention's `key_padding_mask`: True marks padding.
    """
    if (lengths is None) == (padded is None):
        raise ValueError("key_padding_mask: give exactly one of `lengths` (B,) or `padded` (B, N).")
    if padded is not None:
        if padded.dtype != torch.bool or padded.ndim != 2:
            raise ValueError(
                f"`padded` must be a (B, N) bool tensor, got {padded.dtype} {tuple(padded.shape)}"
            )
        return (~padded)[:, None, None, :]
    n = int(lengths.max()) if n is None else n
    valid = torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]  # (B, N)
    return valid[:, None, None, :]


def _combine_masks(mask: Tensor | None, causal: bool, nq: int, nk: int, device) -> Tensor | None:
    if not causal:
        return mask
    tri = causal_mask(nq, nk, device)
    if mask is None:
        return tri
    if mask.dtype == torch.bool:
        return mask & tri
    return mask.masked_fill(~tri, float("-inf"))


def _rows_without_keys(mask: Tensor) -> Tensor:
    """(..., Nq, 1) bool: True for query rows that may look at no key at all."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def _open_empty_rows(mask: Tensor, empty: Tensor) -> Tensor:
    # Let empty rows see every key so softmax stays finite (and gradients NaN-free);
    # their output is zeroed afterwards.
    if mask.dtype == torch.bool:
        return mask | empty
    return mask.masked_fill(empty, 0.0)


def attention_weights(
    q: Tensor, k: Tensor, *, mask: Tensor | None = None, scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """softmax(q kᵀ · scale + mask) over keys: (B, H, Nq, Nk), computed in float32, returned in `dtype`.

    With `dtype` the scores' own half precision, PyTorch's softmax kernel still computes in float32
    and only rounds its output, so the weights are those of the float32 softmax rounded once (a
    handful in 10^5 differ by one unit in the last place), and the backward reads the very weights
    that multiplied the values, at half the memory traffic of a float32 copy.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Nq, Nk)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    return torch.softmax(scores, dim=-1, dtype=dtype)


def _use_fused(q: Tensor, k: Tensor, v: Tensor, return_weights: bool) -> bool:
    if return_weights:
        return False
    half = q.dtype in (torch.bfloat16, torch.float16)
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and half and training and k.shape[-2] <= EXPLICIT_HALF_MAX_KEYS:
        return False
    if q.device.type == "cpu" and half and q.shape[-2] <= EXPLICIT_HALF_MAX_QUERIES:
        return False
    return True


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention. q (B, H, Nq, D), k and v (B, H, Nk, D) -> (B, H, Nq, Dv).

    Without `return_weights` it runs PyTorch's fused kernel (except on CPU in half precision for short
    training sequences and for a few queries per row, as decoding asks, where the explicit path is measured
    to be faster); with it, the explicit softmax
    path, returning (out, weights (B, H, Nq, Nk)). A query row with no key to look at returns zeros.
    `dropout_p` is applied to the weights as given: pass 0 in eval mode.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    fused = _use_fused(q, k, v, return_weights)
    if fused and causal and mask is None and nq == nk:
        # The kernel's own causal mode never builds the (Nq, Nk) mask, and every row sees itself.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale)

    mask = _combine_masks(mask, causal, nq, nk, q.device)
    empty = None
    if mask is not None:
        if mask.dtype != torch.bool and fused:
            mask = mask.to(q.dtype)  # the fused kernel wants an additive mask in the query's dtype
        empty = _rows_without_keys(mask)
        mask = _open_empty_rows(mask, empty)

    if fused:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        weights = None
    else:
        # Returned weights are float32 for inspection; otherwise they stay in the values' dtype, which
        # trains ViT-S/16 in bfloat16 1.11x as fast as a float32 copy would (3% at N = 50).
        weights = attention_weights(q, k, mask=mask, scale=scale,
                                    dtype=torch.float32 if return_weights else v.dtype)
        if empty is not None:
            weights = weights.masked_fill(empty, 0.0)
        dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
        out = dropped.to(v.dtype) @ v  # (B, H, Nq, Dv)

    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    if return_weights:
        return out, weights
    return out


def dot_product_attention(x: Tensor, *, scaled: bool = False, return_weights: bool = False):
    """The parameter-free attention of the tutorials: softmax(X Xᵀ) X for x (..., N, D).

    Every token is its own query, key and value; `scaled` divides the scores by sqrt(D).
    """
    scores = x @ x.transpose(-2, -1)  # (..., N, N)
    if scaled:
        scores = scores / math.sqrt(x.shape[-1])
    weights = scores.softmax(dim=-1)
    out = weights @ x
    return (out, weights) if return_weights else out


@dataclass
class KVCache:
    """Keys and values seen so far, (B, H, T, D) each. Self-attention appends; cross-attention
    computes the context's keys and values once and reuses them."""

    k: Tensor | None = None
    v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        return self.k, self.v

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]


# Set by vitscope.inspect: called with (module, weights (B, H, Nq, Nk)) on every forward.
CaptureFn = Callable[[nn.Module, Tensor], None]


class MultiHeadAttention(nn.Module):
    """Multi-head attention with timm's parameter names.

    Self-attention (default) projects with one fused `qkv` linear. With `cross=True` queries come
    from `x` through `q` and keys/values from `context` through `kv`; the context width
    `context_dim` may differ from `dim`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        head_dim: int | None = None,
        *,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        qk_norm: bool = False,
        cross: bool = False,
        context_dim: int | None = None,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        if head_dim is None:
            if dim % num_heads:
                raise ConfigError(
                    f"dim={dim} is not divisible by num_heads={num_heads}; pass head_dim explicitly."
                )
            head_dim = dim // num_heads
        inner = head_dim * num_heads
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, head_dim**-0.5
        self.cross = cross or context_dim is not None
        if self.cross:
            self.q = nn.Linear(dim, inner, bias=qkv_bias)
            self.kv = nn.Linear(context_dim or dim, 2 * inner, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = nn.Linear(inner, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.capture: CaptureFn | None = None
        # Heads whose output is zeroed before `proj` (head-importance ablation); None = all kept.
        self.head_mask: Tensor | None = None

    def _project(self, x: Tensor, context: Tensor | None, cache: KVCache | None, queries: int | None = None):
        """q (B, H, Nq, D), k and v (B, H, Nk, D) for this call, keys and values through the cache."""
        if not self.cross:
            if context is not None:
                raise ValueError(
                    "this attention was built for self-attention; build it with cross=True for context"
                )
            qkv = self.qkv(x)  # (B, N, 3·H·D)
            q, k, v = rearrange(qkv, "b n (three h d) -> three b h n d", three=3, h=self.num_heads).unbind(0)
            if queries is not None:
                q = q[:, :, :queries]  # (B, H, queries, D)
            k = self.k_norm(k)
            if cache is not None:
                k, v = cache.append(k, v)
            return self.q_norm(q), k, v
        q = rearrange(self.q(x if queries is None else x[:, :queries]), "b n (h d) -> b h n d", h=self.num_heads)
        if cache is not None and cache.k is not None:
            return self.q_norm(q), cache.k, cache.v
        if context is None:
            raise ValueError("cross-attention needs `context` (B, M, context_dim)")
        # unbind, not kv[0] and kv[1]: backward it stacks the two gradients, where each index would fill a zero
        # gradient of the whole kv and the two would then be added
        k, v = rearrange(self.kv(context), "b m (two h d) -> two b h m d", two=2, h=self.num_heads).unbind(0)
        k = self.k_norm(k)
        if cache is not None:
            # contiguous once here, or every later step's q @ kᵀ copies the strided view again
            # (two-thirds of greedy decoding's time before; docs/performance.md)
            k, v = k.contiguous(), v.contiguous()
            cache.k, cache.v = k, v
        return self.q_norm(q), k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        return_weights: bool = False,
        queries: int | None = None,
    ):
        """x (B, N, dim) -> (B, N, dim); with `return_weights` also (B, H, N, Nk).

        `queries=n` computes the output of the first n tokens only, (B, n, dim): every token still
        serves as a key and value, and `mask` may only mask keys, (..., 1, Nk). A ViT whose head
        reads only the class token needs no more from its last block.
        """
        if queries is not None and (causal or (mask is not None and mask.shape[-2] != 1)):
            raise ValueError("queries=n takes a key mask (..., 1, Nk) only, not causal=True or a per-query "
                             "mask; run all queries and slice the output instead")
        want = return_weights or self.capture is not None
        q, k, v = self._project(x, context, cache, queries)
        out = attend(
            q, k, v, mask=mask, causal=causal, scale=self.scale,
            dropout_p=self.attn_drop if self.training else 0.0, return_weights=want,
        )
        weights = None
        if want:
            out, weights = out
            if self.capture is not None:
                self.capture(self, weights)
        if self.head_mask is not None:
            out = out * self.head_mask.to(out.dtype)[None, :, None, None]
        out = rearrange(out, "b h n d -> b n (h d)")
        out = self.proj_drop(self.proj(out))
        return (out, weights) if return_weights else out


class SpatialSelfAttention(nn.Module):
    """Self-attention over the pixels of a feature map (N, C, H, W), with the residual.

    normalise -> flatten to (N, H·W, C) -> multi-head attention -> project -> reshape -> add input.
    `norm` is "group" (GroupNorm with `groups` groups), "batch", "layer" or "none". "layer" is GroupNorm(1, C):
    each image is normalised over all of its C x H x W values together, not each pixel over its C channels.
    """

    def __init__(self, channels: int, num_heads: int = 1, *, norm: str = "group", groups: int = 32,
                 qkv_bias: bool = True):
        super().__init__()
        if channels % num_heads:
            raise ConfigError(f"channels={channels} is not divisible by num_heads={num_heads}")
        if norm == "group":
            self.norm = nn.GroupNorm(math.gcd(groups, channels), channels)
        elif norm == "batch":
            self.norm = nn.BatchNorm2d(channels)
        elif norm == "layer":
            self.norm = nn.GroupNorm(1, channels)
        elif norm == "none":
            self.norm = nn.Identity()
        else:
            raise ConfigError(f"norm must be 'group', 'batch', 'layer' or 'none', got {norm!r}")
        self.attn = MultiHeadAttention(channels, num_heads, qkv_bias=qkv_bias)

    def forward(self, x: Tensor, *, return_weights: bool = False):
        _, _, h, w = x.shape
        tokens = rearrange(self.norm(x), "n c h w -> n (h w) c")
        out = self.attn(tokens, return_weights=return_weights)
        out, weights = out if return_weights else (out, None)
        out = x + rearrange(out, "n (h w) c -> n c h w", h=h, w=w)
        return (out, weights) if return_weights else out


class AdditiveAttention(nn.Module):
    """Bahdanau attention: score(q, k) = vᵀ tanh(W_q q + W_k k), softmax over keys, weighted sum.

    query (B, Dq) or (B, Nq, Dq); keys (B, Nk, Dk); values default to keys. `mask` (B, Nk) or
    (B, Nq, Nk) is True where a key may be attended. `projected_keys` (B, Nk, Hd), W_k k made once by the
    caller, stands in for that projection: an RNN decoder asks at every word with the same keys.
    Returns (context, weights).
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int):
        super().__init__()
        self.query_proj = nn.Linear(query_dim, hidden_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, hidden_dim, bias=True)
        self.score = nn.Linear(hidden_dim, 1, bias=False)

    def forward(
        self, query: Tensor, keys: Tensor, values: Tensor | None = None, *, mask: Tensor | None = None,
        projected_keys: Tensor | None = None,
    ):
        single = query.ndim == 2
        if single:
            query = query[:, None]  # (B, 1, Dq)
        values = keys if values is None else values
        keys_h = self.key_proj(keys) if projected_keys is None else projected_keys  # (B, Nk, Hd)
        # (B, Nq, 1, Hd) + (B, 1, Nk, Hd): every query against every key.
        hidden = torch.tanh(self.query_proj(query)[:, :, None] + keys_h[:, None])
        scores = self.score(hidden).squeeze(-1)  # (B, Nq, Nk)
        if mask is not None:
            mask = mask[:, None] if mask.ndim == 2 else mask
            empty = ~mask.any(-1, keepdim=True)
            scores = scores.masked_fill(~(mask | empty), float("-inf"))
        weights = scores.softmax(dim=-1)
        if mask is not None:
            weights = weights.masked_fill(empty, 0.0)
        context = weights @ values  # (B, Nq, Dv)
        if single:
            return context[:, 0], weights[:, 0]
        return context, weights

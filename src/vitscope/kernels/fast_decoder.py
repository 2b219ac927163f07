"""The Transformer decoder's one-token step through vitscope's kernels: what greedy decoding and beam search call.

Decoding calls the decoder once per word with one new token per row, against the keys and values its caches
hold. A step at caption_quick's shape (32 rows, width 128, 2 blocks) is a few MFLOP, so its time is what
surrounds the arithmetic: the plain decoder's forward goes through each attention module's projection,
rearranges, mask handling and checks, and under bfloat16 autocast casts every linear layer's weights to bfloat16
again at every call; and PyTorch's bfloat16 products of one query row, which the cross-attention asks twice per
block, run at a few GFLOP/s; in float32 each attention is a dozen small ops. `FastTransformerDecoder.forward`
sends such a step to the plain decoder's `TransformerDecoder._step` (vitscope/decoder.py: the block in the few
ops a step needs, the plain forward's numbers bit for bit) and overrides its four seams:

- `step_linears`: every linear layer through one product chosen once per step. In bfloat16 it is the one
  `Linear.forward` would choose (the same kernels, so the same numbers), with the weights cast once and kept on
  the module, recast when a weight changes (its version or storage): half the size of the decoder's linear
  layers. In float32 it is PyTorch's `F.linear`: at a step's 32-160 rows the kernels' float32 products, which
  pack the weight (vitscope's AVX2 product) or set up oneDNN's call at every call, took 1.4-4.4x as long on a
  Zen 3 (docs/performance.md); its numbers are the plain forward's to float32 rounding where that forward
  takes those products (AMD CPUs), bit for bit elsewhere;
- `step_self_attention`: in float32, vitscope's decode-attention kernel (decode_attention.py) over the
  self-attention's cache as it is: one pass instead of PyTorch's dozen ops;
- `step_cross_attention`: in bfloat16 the decode-attention kernel over keys and values packed once per
  decoding: its weights keep float32 scores, so they are closer to the float64 ones than `attend`'s; in
  float32 the float32 kernel over the cache as it is. Both give `attend`'s numbers to their dtype's rounding;
- `step_mlp`: the MLP's two layers through those products, in bfloat16 with fc1's GELU inside its product as
  FastMlp runs it.

Every other call (training, teacher forcing, the first step that fills the caches, hooks, captured or
masked heads, a padding mask on the tokens) runs the plain decoder's forward. Measurements:
docs/performance.md, "Decoding one token at a time".
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitscope.attention import KVCache, MultiHeadAttention
from vitscope.decoder import Caches, DecoderBlock, StepLinear, TransformerDecoder, context_rows, keep_mask
from vitscope.kernels import decode_attention, fused_linear, linear_bf16
from vitscope.kernels.fused_linear import Linear
from vitscope.kernels.guards import DecidesOnSwap, hooked
from vitscope.kernels.modules import FastAttention, FastMlp
from vitscope.kernels.registry import enabled
from vitscope.positional import LearnedPositionalEmbedding
from vitscope.vit import Mlp


def _bfloat16_linear(x: Tensor, w: Tensor, b: Tensor | None, packed: Tensor | None, b32: Tensor | None, *,
                     gelu: bool = False) -> Tensor:
    """`fused_linear.linear(x, w, b, gelu=gelu)` for bfloat16 w and b: where vitscope's product kernel takes the
    layer (`packed`, its weight packed by `linear_bf16.pack`, and `b32`, the bias widened, both made once), that
    kernel without packing the weight again; else `fused_linear.linear` itself. x (..., in) -> (..., out)."""
    if packed is None:
        return fused_linear.linear(x, w, b, gelu=gelu)
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    return linear_bf16.forward(rows, w, b32, gelu=gelu, packed=packed).view(*x.shape[:-1], w.shape[0])


class FastTransformerDecoder(DecidesOnSwap, TransformerDecoder):
    """The decoder whose one-token decoding steps run the plain `_step` through the kernels' seams (the module
    docstring); every other call is the plain decoder's forward."""

    def _decide(self) -> None:
        blocks = list(self.blocks)
        attention = (MultiHeadAttention, FastAttention)
        self._steps = bool(blocks) and all(
            type(b) is DecoderBlock and type(b.self_attn) in attention and type(b.cross_attn) in attention
            and type(b.mlp) in (Mlp, FastMlp) and all(type(n) is nn.LayerNorm for n in (b.norm1, b.norm2, b.norm3))
            and all(isinstance(a.q_norm, nn.Identity) and isinstance(a.k_norm, nn.Identity)
                    for a in (b.self_attn, b.cross_attn))
            for b in blocks
        ) and type(self.norm) is nn.LayerNorm and type(self.token_embed) is nn.Embedding and type(
            self.pos_embed) is LearnedPositionalEmbedding
        # FastMlp's bfloat16 path, fc1's GELU inside its product, where every MLP would take it
        self._fused_mlps = self._steps and all(type(b.mlp) is FastMlp and b.mlp._exact for b in blocks)
        self._linears: list[nn.Module] = []  # every linear layer of a step: `_products` runs them
        if self._steps:
            self._linears = [m for b in blocks for m in (b.self_attn.qkv, b.self_attn.proj, b.cross_attn.q,
                                                         b.cross_attn.proj, b.mlp.fc1, b.mlp.fc2)] + [self.head]
            self._steps = all(type(m) in (nn.Linear, Linear) for m in self._linears)
        # the layers `Linear` (vitscope's): then the step calls the product each one's forward would choose
        self._kernel_linears = self._steps and all(type(m) is Linear for m in self._linears)
        self._watched = list(self.modules())  # what a hook on any of them would see skipped
        self._cast: tuple[tuple, dict[nn.Module, tuple]] | None = None  # (the weights' versions, their casts)
        self._packs: list[tuple | None] = [None] * len(blocks)  # per block: its cross cache's packed keys, values

    def __getstate__(self) -> dict:
        """Copies and pickles leave the kept weights and packed keys behind: they are remade on the first step."""
        state = dict(super().__getstate__())
        state["_cast"], state["_packs"] = None, [None] * len(self._packs)
        return state

    def forward(self, tokens: Tensor, context: Tensor | None, *, padding_mask: Tensor | None = None,
                context_padding_mask: Tensor | None = None, caches: Caches | None = None,
                return_weights: bool = False):
        if not self._one_token(tokens, padding_mask, caches):
            return super().forward(tokens, context, padding_mask=padding_mask,
                                   context_padding_mask=context_padding_mask, caches=caches,
                                   return_weights=return_weights)
        return self._step(tokens, keep_mask(context_padding_mask), caches, return_weights)

    def _one_token(self, tokens: Tensor, padding_mask: Tensor | None, caches: Caches | None) -> bool:
        """Whether this call is a decoding step `_step` may take: one new token per row after a filled cache,
        inference on the CPU, the decoder's own modules untouched by hooks, captures or head masks."""
        if not (self._steps and enabled() and tokens.is_cpu and tokens.ndim == 2 and tokens.shape[1] == 1
                and caches is not None and padding_mask is None and not self.training
                and not torch.is_grad_enabled()):
            return False
        if len(caches) != len(self.blocks) or any(len(s) == 0 or c.k is None for s, c in caches):
            return False  # the plain decoder fills the caches, or says what is wrong with them
        rows = context_rows(None, caches, tokens.shape[0])
        if tokens.shape[0] % rows or len(caches[0][0]) >= self.pos_embed.weight.shape[0]:
            return False  # the plain decoder's error
        if any(a.capture is not None or a.head_mask is not None
               for b in self.blocks for a in (b.self_attn, b.cross_attn)):
            return False
        return not hooked(*self._watched)

    def _products(self, x: Tensor) -> tuple[Callable[..., Tensor], dict[nn.Module, tuple]] | None:
        """How this step's linear layers run: (the function, each layer's (weight, bias) for it), chosen once from
        the first layer (they all see the same dtypes and flags); None where the layers are not vitscope's (then
        each runs its own forward). In bfloat16 the product `Linear.forward` would choose, the weights cast once
        and kept while they stay the same; in float32 `F.linear`, faster than the kernels' products at a step's
        few rows (the module docstring)."""
        first = self._linears[0]
        if not self._kernel_linears:
            return None
        if fused_linear.fusable(x, first.weight, first.bias):
            return self._bfloat16_products(x)
        if fused_linear.compiled_float32(x, first.weight, first.bias):
            return None
        return F.linear, {m: (m.weight, m.bias) for m in self._linears}

    def _bfloat16_products(self, x: Tensor) -> tuple[Callable[..., Tensor], dict[nn.Module, tuple]]:
        """The bfloat16 path's: each layer's weight and bias cast once, kept while they stay the same, and where
        vitscope's product kernel takes the layer (linear_bf16.py) its weight packed once too."""
        params = [p for m in self._linears for p in (m.weight, m.bias) if p is not None]
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
        if self._cast is None or self._cast[0] != key:
            weights = {}
            for m in self._linears:
                w = m.weight.to(torch.bfloat16)
                b = None if m.bias is None else m.bias.to(torch.bfloat16)
                probe = torch.empty(1, w.shape[1], dtype=torch.bfloat16)  # a row as the layer's input
                kernel = linear_bf16.runnable(probe, w, b)
                weights[m] = (w, b, linear_bf16.pack(w) if kernel else None, b.float() if kernel and b is not None
                              else None)
            self._cast = (key, weights)
        return _bfloat16_linear, self._cast[1]

    def _packed(self, i: int, cache, q: Tensor) -> tuple[Tensor, Tensor]:
        """Block i's cross-attention keys and values in the bfloat16 decode-attention kernel's layout, packed once
        per decoding (the cache they come from is new for each)."""
        entry = self._packs[i]
        # weak references: a finished decoding's keys and values are not kept alive by the packed copies. The
        # cache's tensors are written once, when it is filled, and never in place after.
        if entry is None or entry[0]() is not cache.k or entry[1]() is not cache.v:
            entry = (weakref.ref(cache.k), weakref.ref(cache.v), decode_attention.pack(cache.k, cache.v))
            self._packs[i] = entry
        return entry[2]

    # The plain decoder's step seams (TransformerDecoder._step), taken where a step's layers allow.
    def step_linears(self, x: Tensor) -> StepLinear:
        """Every linear layer of the step through the one product `_products` chooses from x, with the weights it
        keeps; each layer's own forward where it chooses none."""
        products = self._products(x)
        return super().step_linears(x) if products is None else _Products(*products)

    def step_self_attention(self, attn: MultiHeadAttention, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """In float32, vitscope's decode-attention kernel over the self-attention's cache as it is (it grows by a
        token a step, so nothing is packed); else the plain step's `attend`."""
        if q.dtype != torch.float32 or not decode_attention.usable(q, k, v):
            return super().step_self_attention(attn, q, k, v)
        return decode_attention.attend_f32(q, k, v, attn.scale, weights=False)[0]  # (R, 1, H·Dh)

    def step_cross_attention(self, i: int, attn: MultiHeadAttention, q: Tensor, cache: KVCache,
                             context_mask: Tensor | None, return_weights: bool) -> tuple[Tensor, Tensor | None]:
        """vitscope's decode-attention kernels where they run: in bfloat16 over block i's keys and values packed
        once per decoding, in float32 over the cache as it is; else the plain step's `attend`."""
        if not decode_attention.usable(q, cache.k, cache.v, context_mask):
            return super().step_cross_attention(i, attn, q, cache, context_mask, return_weights)
        if q.dtype == torch.float32:
            return decode_attention.attend_f32(q, cache.k, cache.v, attn.scale, context_mask, return_weights)
        return decode_attention.attend(q, self._packed(i, cache, q), cache.k.shape[2], attn.scale, context_mask,
                                       return_weights)

    def step_mlp(self, mlp: Mlp, x: Tensor, linear: StepLinear) -> Tensor:
        """fc2(act(fc1(x))) through the step's products (dropout is off in inference), on FastMlp's bfloat16
        inference path with fc1's GELU inside its product, as it would run it; the MLP's own forward where the
        step's layers run their own."""
        if not isinstance(linear, _Products):
            return super().step_mlp(mlp, x, linear)
        if linear.fn is _bfloat16_linear and self._fused_mlps:
            return linear.fn(linear.fn(x, *linear.args[mlp.fc1], gelu=True), *linear.args[mlp.fc2])
        return linear(mlp.act(linear(x, mlp.fc1)), mlp.fc2)


class _Products:
    """A step's linear layers through one product function `fn`, each layer with its arguments for it (its weight
    and bias; on the bfloat16 path cast once and kept): the `linear(x, layer)` that `step_linears` hands the
    step."""

    __slots__ = ("fn", "args")

    def __init__(self, fn: Callable[..., Tensor], args: dict[nn.Module, tuple]):
        self.fn, self.args = fn, args

    def __call__(self, x: Tensor, layer: nn.Module) -> Tensor:
        return self.fn(x, *self.args[layer])

"""The fast modules: subclasses of the model's own that run vitscope's kernels where a call allows.

`apply(model)` swaps each module's class in place (`module.__class__ = Fast...`), the way
`ipex.optimize` swaps in its modules: parameters, buffers, state_dict keys, DDP wrappers, EMA copies
and hooks stay as they are, and `revert(model)` swaps them back. What a module's type and settings
decide (which children it has, LayerScale, qk-norm, a conv stem) is decided once, when the class is
swapped in (`_decide`); what can change between calls (hooks, capture, head masks, dropout in
training, the dtype under autocast) is checked on each call, and anything a user could observe sends
the call to the plain module's forward.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from vitscope.attention import MultiHeadAttention, attend
from vitscope.kernels import (
    fused_add_norm,
    fused_bn_gelu,
    fused_conv,
    fused_layer_norm,
    fused_linear,
    fused_mlp,
    fused_residual,
    short_attention,
)
from vitscope.kernels.fused_gelu import GELU
from vitscope.kernels.fused_linear import Linear
from vitscope.kernels.guards import DecidesOnSwap, dropping, hooked, records
from vitscope.kernels.registry import enabled
from vitscope.vit import Block, ConvStem, Mlp, PatchEmbed, VisionTransformer


class FastMlp(DecidesOnSwap, Mlp):
    """fc1 -> GELU -> fc2 with, in bfloat16 inference, fc1's bias and the GELU inside its product
    (fused_linear.py), and in training the GELU's derivative kept instead of its input (fused_mlp.py)."""

    def _decide(self) -> None:
        self._exact = (type(self.act) in (nn.GELU, GELU) and self.act.approximate == "none"
                       and type(self.fc1) is Linear and type(self.fc2) is Linear)
        self._reads_through_linear = type(self.fc1) is Linear  # what a bfloat16 norm before it may feed

    def forward(self, x: Tensor) -> Tensor:
        if not (x.is_cpu and enabled() and self._exact) or dropping(self.drop1):
            return super().forward(x)
        w1, b1, w2, b2 = self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias
        if (fused_linear.fusable(x, w1, b1) and not fused_linear.needs_grad(x, w1, b1)
                and not hooked(self.fc1, self.act, self.drop1)):
            return self.drop2(self.fc2(fused_linear.linear(x, w1, b1, gelu=True)))
        if fused_mlp.fusable(x, w1, b1, w2, b2) and not hooked(self.fc1, self.act, self.drop1, self.fc2):
            return self.drop2(fused_mlp.mlp(x, w1, b1, w2, b2))
        return super().forward(x)


class FastAttention(DecidesOnSwap, MultiHeadAttention):
    """Self-attention straight from the fused qkv projection into vitscope's attention kernels, which
    write the heads side by side as `proj` reads them (short_attention.py)."""

    def _decide(self) -> None:
        self._plain = (not self.cross and isinstance(self.q_norm, nn.Identity)
                       and isinstance(self.k_norm, nn.Identity))
        self._reads_through_linear = self._plain and type(self.qkv) is Linear

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                causal: bool = False, cache=None, return_weights: bool = False, queries: int | None = None):
        if not (x.is_cpu and enabled() and self._plain and context is None and mask is None and not causal
                and cache is None and not return_weights and self.capture is None and self.head_mask is None
                and (self.attn_drop == 0.0 or not self.training)):
            return super().forward(x, context, mask=mask, causal=causal, cache=cache,
                                   return_weights=return_weights, queries=queries)
        qkv = self.qkv(x)  # (B, N, 3·H·D)
        if short_attention.usable_qkv(qkv, self.num_heads, queries):
            out = short_attention.attend_qkv(qkv, self.num_heads, self.scale, queries)  # (B, Nq, H·D)
            return self.proj_drop(self.proj(out))
        q, k, v = rearrange(qkv, "b n (three h d) -> three b h n d", three=3, h=self.num_heads).unbind(0)
        q = q if queries is None else q[:, :, :queries]  # (B, H, Nq, D)
        if short_attention.usable(q, k, v):
            out = short_attention.attend(q, k, v, self.scale)
        else:
            out = attend(q, k, v, scale=self.scale)
        return self.proj_drop(self.proj(rearrange(out, "b h n d -> b n (h d)")))


class FastBlock(DecidesOnSwap, Block):
    """The pre-norm block with, under bfloat16 autocast, each LayerNorm writing bfloat16 for the linear
    layer that reads it (fused_layer_norm.py), the residual adds in one pass (fused_residual.py), and a
    residual add and the next LayerNorm together (fused_add_norm.py), also across blocks
    (`forward_chained`, which FastViT's loop calls)."""

    def _decide(self) -> None:
        self._plain_residuals = type(self.ls1) is nn.Identity and type(self.ls2) is nn.Identity
        self._fast_attn = type(self.attn) is FastAttention
        self._fast_mlp = type(self.mlp) is FastMlp

    @property
    def _norm1_feeds(self) -> bool:
        """Whether norm1 may hand its output to attn in bfloat16 (attn's qkv would cast it so)."""
        return self._fast_attn and self.attn._reads_through_linear

    @property
    def _norm2_feeds(self) -> bool:
        return self._fast_mlp and self.mlp._reads_through_linear

    def forward(self, x: Tensor, *, queries: int | None = None) -> Tensor:
        """x (B, N, D) -> (B, N, D); with `queries=n`, only the first n tokens' outputs, (B, n, D)."""
        if not (x.is_cpu and enabled()):
            if queries is None:
                return super().forward(x)
            x = x[:, :queries] + self.drop_path1(self.ls1(self.attn(self.norm1(x), queries=queries)))
            return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return self.forward_chained(x, None, None, queries=queries)[0]

    def _norm(self, norm: nn.LayerNorm, x: Tensor, feeds: bool, consumer: nn.Module) -> Tensor:
        """norm(x), under bfloat16 autocast straight to the bfloat16 its consumer's first linear would cast it to."""
        if feeds and fused_layer_norm.fusable(x, norm) and not hooked(norm, consumer, _first(consumer)):
            return fused_layer_norm.layer_norm(x, norm)
        return norm(x)

    def _residual(self, x: Tensor, branch: Tensor, ls: nn.Module, drop_path: nn.Module, *,
                  own_x: bool = False) -> Tensor:
        """x + drop_path(ls(branch)); a bfloat16 branch added in one pass, into x itself where `own_x`."""
        plain = self._plain_residuals and not _dropping_path(drop_path) and not hooked(drop_path)
        if plain and fused_residual.fusable(x, branch):
            if own_x and not records(x, branch):
                return fused_residual.add_(x, branch)
            return fused_residual.add(x, branch)
        return x + drop_path(ls(branch))

    def _add_norm(self, x: Tensor, branch: Tensor, drop_path: nn.Module, norm: nn.LayerNorm, feeds: bool,
                  consumer: nn.Module, *, own_x: bool = False) -> tuple[Tensor, Tensor] | None:
        """(x + branch, norm of it in bfloat16) in one pass where both would run the kernels; else None."""
        if not (self._plain_residuals and feeds) or _dropping_path(drop_path):
            return None
        if hooked(drop_path, norm, consumer, _first(consumer)):
            return None
        if not fused_add_norm.fusable(x, branch, norm):
            return None
        out = x if own_x and not records(x, branch) else None
        return fused_add_norm.add_layer_norm(x, branch, norm, out=out)

    def forward_chained(self, x: Tensor, normed: Tensor | None, following: FastBlock | None, *,
                        queries: int | None = None) -> tuple[Tensor, Tensor | None]:
        """`forward`, where `normed` is norm1(x) in bfloat16 if the block before computed it, and with
        `following` (the next block) this block's last residual add and following.norm1 in one pass.
        Returns (the output, following.norm1 of it in bfloat16, or None)."""
        h = self._norm(self.norm1, x, self._norm1_feeds, self.attn) if normed is None else normed
        attn = self.attn(h, queries=queries)
        x = x if queries is None else x[:, :queries]
        fused = self._add_norm(x, attn, self.drop_path1, self.norm2, self._norm2_feeds, self.mlp)
        if fused is None:
            x = self._residual(x, attn, self.ls1, self.drop_path1)
            h = self._norm(self.norm2, x, self._norm2_feeds, self.mlp)
        else:
            x, h = fused  # x + attn is this block's own tensor: the next sum may go into it
        mlp = self.mlp(h)
        if following is not None:
            chained = self._add_norm(x, mlp, self.drop_path2, following.norm1, following._norm1_feeds,
                                     following.attn, own_x=fused is not None)
            if chained is not None:
                return chained
        return self._residual(x, mlp, self.ls2, self.drop_path2, own_x=fused is not None), None


def _first(consumer: nn.Module) -> nn.Module:
    """The linear layer that reads a norm's output in `consumer` (an attention's qkv or an MLP's fc1)."""
    return consumer.fc1 if isinstance(consumer, Mlp) else consumer.qkv


def _dropping_path(drop_path: nn.Module) -> bool:
    return drop_path.training and getattr(drop_path, "p", 0.0) > 0


class FastConvStem(DecidesOnSwap, ConvStem):
    """The conv stem with each BatchNorm and the GELU after it in one kernel (fused_bn_gelu.py), and in
    training each conv's weight gradient from vitscope's kernel (fused_conv.py), in channels-last memory."""

    def forward(self, x: Tensor) -> Tensor:
        if not (x.is_cpu and enabled()) or hooked():
            return super().forward(x)
        mods, i = list(self), 0
        while i < len(mods):
            if i + 1 < len(mods) and fused_bn_gelu.fusable(x, mods[i], mods[i + 1]) and not hooked(*mods[i:i + 2]):
                x, i = fused_bn_gelu.bn_gelu(x, mods[i]), i + 2
            elif fused_conv.fusable(x, mods[i]) and not hooked(mods[i]):
                x, i = fused_conv.conv2d(x, mods[i]), i + 1
            else:
                x, i = mods[i](x), i + 1
        return x


class FastPatchEmbed(DecidesOnSwap, PatchEmbed):
    """Patch embedding with, in bfloat16, the stride-P conv run as the linear map of each flattened patch
    that it is (oneDNN's fused linear is 2-3x as fast as its conv, same weights); a conv stem runs in
    channels-last memory, which oneDNN's convs are faster in."""

    def _decide(self) -> None:
        if self.stem is not None:
            self.to(memory_format=torch.channels_last)

    def _undecide(self) -> None:
        if self.stem is not None:
            self.to(memory_format=torch.contiguous_format)

    def forward(self, x: Tensor) -> Tensor:
        if not (x.is_cpu and enabled()):
            return super().forward(x)
        self.check(x)
        w, b = self.proj.weight, self.proj.bias
        if self.stem is None and type(self.proj) is nn.Conv2d and not hooked(self.proj):
            if fused_linear.fusable(x, w, b):
                p = self.patch_size
                patches = rearrange(x.to(torch.bfloat16), "b c (h p) (w q) -> b (h w) (c p q)", p=p, q=p)
                return fused_linear.linear(patches, w.reshape(w.shape[0], -1), b)  # (B, N, D)
        if self.stem is not None:
            # (B, C, H, W) with (B, H, W, C) memory, like the weights; the flatten below is then a view
            x = self.stem(x.contiguous(memory_format=torch.channels_last))
        return rearrange(self.proj(x), "b d h w -> b (h w) d")


class FastViT(DecidesOnSwap, VisionTransformer):
    """The ViT whose loop over blocks (the plain model's `run_blocks` seam) chains each block's last residual add
    with the next one's norm1 (FastBlock.forward_chained), and whose last block, where the head reads the class
    token alone (the `head_tokens` seam), computes that one token's output (all tokens are still its keys and
    values): the same logits for 1/8 fewer FLOPs at depth 6. `forward` and `forward_features` are the plain
    model's."""

    def run_blocks(self, x: Tensor, last_queries: int | None = None) -> Tensor:
        blocks = list(self.blocks)
        chain = enabled() and x.is_cpu and all(type(b) is FastBlock for b in blocks) and not hooked(*blocks)
        normed = None
        for i, block in enumerate(blocks):
            last = i == len(blocks) - 1
            queries = last_queries if last else None
            if chain:
                x, normed = block.forward_chained(x, normed, None if last else blocks[i + 1], queries=queries)
            else:
                x = block(x, queries=queries) if queries else block(x)
        return x

    def head_tokens(self, x: Tensor) -> Tensor:
        if not self._only_class_token_read():
            return self.forward_features(x)
        return self.norm(self.run_blocks(self.embed(x), last_queries=1))  # (B, 1, D): the class token alone

    def _only_class_token_read(self) -> bool:
        """True when nothing but the head sees the last block's output: token pooling, a FastBlock last,
        and no capture or hook on it or the final norm that would expect every token."""
        if self.global_pool != "token" or not len(self.blocks) or type(self.blocks[-1]) is not FastBlock:
            return False
        last = self.blocks[-1]
        return last.attn.capture is None and not hooked(*last.modules(), *self.norm.modules())


__all__ = ["FastAttention", "FastBlock", "FastConvStem", "FastMlp", "FastPatchEmbed", "FastViT"]

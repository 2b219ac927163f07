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
from vitscope.conv_stem import ConvStem
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
from vitscope.vit import Block, Mlp, PatchEmbed, VisionTransformer


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
    write the heads side by side as `proj` reads them (short_attention.py); cross-attention without a
    mask or cache (a captioner's teacher-forced training) through the same kernels from the q and kv
    projections (`attend_q_kv`)."""

    def _decide(self) -> None:
        unnormed = isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)
        self._plain = not self.cross and unnormed
        self._plain_cross = self.cross and unnormed
        self._reads_through_linear = self._plain and type(self.qkv) is Linear

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None,
                causal: bool = False, cache=None, return_weights: bool = False, queries: int | None = None):
        takes = self._plain and context is None or self._plain_cross and context is not None
        if not (x.is_cpu and enabled() and takes
                and mask is None and not causal and cache is None and not return_weights and self.capture is None
                and self.head_mask is None and (self.attn_drop == 0.0 or not self.training)):
            return super().forward(x, context, mask=mask, causal=causal, cache=cache,
                                   return_weights=return_weights, queries=queries)
        if self.cross:
            q = self.q(x if queries is None else x[:, :queries])  # (B, Nq, H·D)
            kv = self.kv(context)  # (B, Nk, 2·H·D)
            if short_attention.usable_q_kv(q, kv, self.num_heads):
                out = short_attention.attend_q_kv(q, kv, self.num_heads, self.scale)  # (B, Nq, H·D)
            else:  # the projections it has, through PyTorch's attention
                qh, k, v = short_attention.split_q_kv(q, kv, self.num_heads)
                out = rearrange(attend(qh, k, v, scale=self.scale), "b h n d -> b n (h d)")
            return self.proj_drop(self.proj(out))
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
    """The pre-norm block through the plain block's seams: under bfloat16 autocast each LayerNorm writing bfloat16
    for the linear layer that reads it (`layer_norm`, fused_layer_norm.py), and a residual add in one pass
    (fused_residual.py) or together with the LayerNorm that reads its sum (`add_norm`, fused_add_norm.py), also
    across blocks where FastViT's loop hands each block the next one (`Block.forward_normed`)."""

    def _decide(self) -> None:
        self._plain_residuals = type(self.ls1) is nn.Identity and type(self.ls2) is nn.Identity

    def layer_norm(self, norm: nn.Module, x: Tensor, reader: nn.Module) -> Tensor:
        """norm(x), under bfloat16 autocast straight to the bfloat16 its reader's first linear would cast it to."""
        if (x.is_cpu and enabled() and _reads_through_linear(reader) and fused_layer_norm.fusable(x, norm)
                and not hooked(norm, reader, _first(reader))):
            return fused_layer_norm.layer_norm(x, norm)
        return norm(x)

    def add_norm(self, x: Tensor, branch: Tensor, ls: nn.Module, drop_path: nn.Module, norm: nn.Module | None,
                 reader: nn.Module | None) -> tuple[Tensor, Tensor | None]:
        """(x + drop_path(ls(branch)), norm of it): both in one pass where both would run the kernels, else a
        bfloat16 branch added in one pass. The block's second sum may go into x itself: x is then the block's own
        tensor, which only norm2 read."""
        if not (x.is_cpu and enabled() and self._plain_residuals) or _dropping_path(drop_path):
            return super().add_norm(x, branch, ls, drop_path, norm, reader)
        into_x = drop_path is self.drop_path2 and not hooked(self.norm2) and not records(x, branch)
        if (norm is not None and _reads_through_linear(reader) and fused_add_norm.fusable(x, branch, norm)
                and not hooked(drop_path, norm, reader, _first(reader))):
            return fused_add_norm.add_layer_norm(x, branch, norm, out=x if into_x else None)
        if fused_residual.fusable(x, branch) and not hooked(drop_path):
            x = fused_residual.add_(x, branch) if into_x else fused_residual.add(x, branch)
            return x, None if norm is None else self.layer_norm(norm, x, reader)
        return super().add_norm(x, branch, ls, drop_path, norm, reader)


def _reads_through_linear(reader: nn.Module | None) -> bool:
    """Whether `reader` casts a norm's output to bfloat16 in vitscope's linear layer, so the norm may write it so."""
    return type(reader) in (FastAttention, FastMlp) and reader._reads_through_linear


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
    with the next one's norm1 (`Block.forward_normed`), and whose last block, where the head reads the class
    token alone (the `head_tokens` seam), computes that one token's output (all tokens are still its keys and
    values): the same logits for 1/8 fewer FLOPs at depth 6. `forward` and `forward_features` are the plain
    model's."""

    def run_blocks(self, x: Tensor, *, last_queries: int | None = None) -> Tensor:
        blocks = list(self.blocks)
        if not (enabled() and x.is_cpu and blocks and all(type(b) is FastBlock for b in blocks)) or hooked(*blocks):
            return super().run_blocks(x, last_queries=last_queries)
        h = blocks[0].layer_norm(blocks[0].norm1, x, blocks[0].attn)
        for block, following in zip(blocks, blocks[1:] + [None]):
            queries = last_queries if following is None else None
            x, h = block.forward_normed(x, h, queries=queries, following=following)
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

"""A residual add and the LayerNorm after it in one pass (CPU, bfloat16 autocast).

In a pre-norm block, `x + attn` is read at once by norm2, and `x + mlp` by the next block's norm1.
Done apart (fused_residual.add, then fused_layer_norm.layer_norm), the float32 sum is written to memory
and read back; here each row is added, written and normalised while it is in cache (native/layer_norm.c,
`vs_add_layer_norm_fwd`). The numbers are the same as the two kernels': the sum is the same float32
value and LayerNorm reads it. The backward is LayerNorm's with the sum's own gradient added in the same
pass, which also writes the branch's gradient: the same values rounded to bfloat16 (add's backward).

The fast block (kernels/modules.py, FastBlock) uses it for its first residual with norm2 and, in a model's
loop over blocks nothing hooks, for its second residual with the next block's norm1, where both halves
would run vitscope's kernels: the residual's branch has no LayerScale or stochastic depth, the norm and
the linear layer reading it are not hooked (nothing could see the LayerNorm's float32 output go missing),
a float32 stream, under the conditions of the two kernels. In inference the second sum goes into the
first, in place. Double backward is not supported (it raises).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import fused_layer_norm, fused_residual, native, registry


def fusable(x: Tensor, branch: Tensor, norm: nn.Module) -> bool:
    """Whether `add_layer_norm(x, branch, norm)` may stand in for `s = x + branch; norm(s)` under bfloat16
    autocast, the norm's output cast to bfloat16: x float32, branch bfloat16, both contiguous, one shape."""
    if not (fused_residual.fusable(x, branch) and fused_layer_norm.fusable(x, norm)):  # the first: x float32
        return False
    return registry.runnable("residual add + layer norm", torch.bfloat16, x, branch)


class _AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, branch: Tensor, weight: Tensor, bias: Tensor, eps: float,
                out: Tensor | None) -> tuple[Tensor, Tensor]:
        c = x.shape[-1]
        rows = x.numel() // c
        s = torch.empty_like(x) if out is None else out
        y = torch.empty(x.shape, dtype=torch.bfloat16)
        keep = any(ctx.needs_input_grad)
        mean, rstd = (torch.empty(rows), torch.empty(rows)) if keep else (None, None)
        native.library().vs_add_layer_norm_fwd(
            x.data_ptr(), branch.data_ptr(), s.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(),
            mean.data_ptr() if keep else None, rstd.data_ptr() if keep else None, rows, c, eps,
            torch.get_num_threads())
        if keep:
            ctx.save_for_backward(s, weight, mean, rstd)
        return s, y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, ds: Tensor, dy: Tensor):
        s, weight, mean, rstd = ctx.saved_tensors
        ds = ds.to(torch.float32).contiguous()
        dy = dy.to(torch.bfloat16).contiguous()
        c, threads = s.shape[-1], torch.get_num_threads()
        dx = torch.empty_like(s)
        dbranch = torch.empty(s.shape, dtype=torch.bfloat16)  # dx rounded, written in the same pass
        partial = torch.empty(threads, 2, c)  # each thread's sums of dy xhat and dy
        native.library().vs_add_layer_norm_bwd(dy.data_ptr(), s.data_ptr(), weight.data_ptr(), mean.data_ptr(),
                                               rstd.data_ptr(), ds.data_ptr(), dx.data_ptr(), dbranch.data_ptr(),
                                               partial.data_ptr(),
                                               s.numel() // c, c, threads)
        sums = partial.sum(0)
        return dx, dbranch, sums[0], sums[1], None, None


def add_layer_norm(x: Tensor, branch: Tensor, norm: nn.LayerNorm, *,
                   out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(x + branch, norm(x + branch) in bfloat16), x (..., C) float32 and branch bfloat16 of one shape.
    Call it only where `fusable(x, branch, norm)` says. `out=x` writes the sum into x itself (each row is
    read before it is written): only where nothing else holds x and autograd records nothing, since the
    write moves no version counter."""
    return _AddLayerNorm.apply(x, branch, norm.weight, norm.bias, float(norm.eps), out)

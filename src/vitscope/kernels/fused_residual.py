"""The residual add of a bfloat16 branch into the float32 stream, in one pass (CPU, bfloat16 autocast).

`x + y` with x float32 and y bfloat16 makes PyTorch copy y into a new float32 tensor and then add:
three passes over the activation where one does. vitscope's C kernel (native/residual.c) widens
and adds in the same pass; the result is the same float32 number (y widens exactly). The backward is
add's: the gradient itself for x, cast to bfloat16 for y. The fast block (kernels/modules.py) uses it for
both residuals where
the branch has no LayerScale or stochastic depth, under the same conditions as the other kernels
(CPU, contiguous tensors of one shape, outside torch.compile, tracing, forward-mode AD and
torch.func, vitscope's kernels loaded).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native, registry


def fusable(x: Tensor, y: Tensor) -> bool:
    """Whether `add(x, y)` may stand in for `x + y`: x float32, y bfloat16, both contiguous, one shape."""
    if x.device.type != "cpu" or y.device.type != "cpu" or x.dtype != torch.float32 or y.dtype != torch.bfloat16:
        return False
    if x.shape != y.shape or not (x.is_contiguous() and y.is_contiguous()):
        return False
    return registry.runnable("residual add", torch.bfloat16, x, y)


class _Add(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor) -> Tensor:  # ctx here: no per-call signature binding (fused_linear)
        out = torch.empty_like(x)
        native.library().vs_add_bf16(x.data_ptr(), y.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads())
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, g.to(torch.bfloat16)


def add(x: Tensor, y: Tensor) -> Tensor:
    """x + y, x float32 and y bfloat16 of one shape -> float32. Call it only where `fusable(x, y)` says."""
    return _Add.apply(x, y)


def add_(x: Tensor, y: Tensor) -> Tensor:
    """x += y in place, x float32 and y bfloat16 of one shape; returns x. For a stream that nothing else
    holds, where autograd records nothing: call it only where `fusable(x, y)` says and neither tensor
    needs a gradient. In place, the sum's pass writes the lines it has just read instead of fresh ones."""
    native.library().vs_add_bf16(x.data_ptr(), y.data_ptr(), x.data_ptr(), x.numel(), torch.get_num_threads())
    return x

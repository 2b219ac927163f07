"""LayerNorm that reads the float32 residual stream and writes bfloat16 for the linear layer after it, on CPU.

Under bfloat16 autocast PyTorch runs LayerNorm in float32 and writes a float32 output, which the next
linear layer reads again to cast it to bfloat16; in the backward the bfloat16 gradient is cast up
before LayerNorm's backward reads it. vitscope's C kernels (native/layer_norm.c) compute in float32
as PyTorch does, round the output once to bfloat16 in the same pass, and take the bfloat16 gradient
directly: two passes over the activation fewer each way. The output is exactly autocast's cast of
PyTorch's float32 output up to float32 summation order.

A residual stream that autocast leaves in bfloat16 (a model whose position table is cast to the
activations' dtype, such as vit_fmnist_quick's sin-cos table) takes the same kernels reading bfloat16
and writing a bfloat16 input gradient, as PyTorch's bfloat16 LayerNorm gives, but with the weight and
bias gradients summed in float32 (PyTorch's were 2% of their size off float64 in the test).
Measurements: docs/performance.md, "LayerNorm, the residual add, and both in one pass".

The fast block (kernels/modules.py) uses it for norm1 and norm2 where the consumer is vitscope's own
attention or MLP, which would cast the input to bfloat16 anyway: under CPU bfloat16 autocast, float32 or
bfloat16 input, an affine LayerNorm over the last dim, nothing hooked on the norm or its consumer, outside
torch.compile, tracing, forward-mode AD and torch.func, and where vitscope's kernels load. Double backward
is not supported (it raises).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import native, registry


def fusable(x: Tensor, norm: nn.Module) -> bool:
    """Whether `layer_norm(x, norm)` may stand in for `norm(x)` followed by autocast's cast to bfloat16."""
    if type(norm) is not nn.LayerNorm or norm.weight is None or norm.bias is None or len(norm.normalized_shape) != 1:
        return False
    if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16):
        return False
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.shape[-1] != norm.normalized_shape[0]:
        return False
    if norm.weight.dtype != torch.float32 or norm.bias.dtype != torch.float32 or not x.is_contiguous():
        return False
    return registry.runnable("layer norm", torch.bfloat16, x, norm.weight, norm.bias)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        c = x.shape[-1]
        rows = x.numel() // c
        y = torch.empty(x.shape, dtype=torch.bfloat16)
        mean, rstd = torch.empty(rows), torch.empty(rows)
        lib = native.library()
        fwd = lib.vs_layer_norm_bf16_fwd if x.dtype == torch.bfloat16 else lib.vs_layer_norm_fwd
        fwd(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), rows, c,
            eps, torch.get_num_threads())
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        dy = dy.to(torch.bfloat16).contiguous()
        c, threads = x.shape[-1], torch.get_num_threads()
        dx = torch.empty_like(x)  # x's dtype: float32, or bfloat16 for a bfloat16 stream
        partial = torch.empty(threads, 2, c)  # each thread's sums of dy xhat and dy
        lib = native.library()
        bwd = lib.vs_layer_norm_bf16_bwd if x.dtype == torch.bfloat16 else lib.vs_layer_norm_bwd
        bwd(dy.data_ptr(), x.data_ptr(), weight.data_ptr(), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
            partial.data_ptr(), x.numel() // c, c, threads)
        sums = partial.sum(0)
        return dx, sums[0], sums[1], None


def layer_norm(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """norm(x) in bfloat16, x (..., C) float32 or bfloat16. Call it only where `fusable(x, norm)` says."""
    return _LayerNorm.apply(x, norm.weight, norm.bias, float(norm.eps))

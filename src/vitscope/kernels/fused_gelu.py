"""GELU on CPU in vitscope's kernels: bfloat16 from a table, with its derivative kept for training, and
float32 on CPUs without AVX-512.

A bfloat16 input takes one of 65536 values, and native/gelu.c keeps GELU and its derivative for each,
computed in float64 and rounded: a pass of lookups gives the correctly rounded results (PyTorch's
bfloat16 GELU, a float32 evaluation, is an ulp off for about one element in a thousand). In training,
the pass writes GELU's output and its derivative, the derivative is kept instead of the input, and
the backward is one multiply, where PyTorch's GELU backward computes erf and exp again.

Three places use it:
- the conv stem's activation (the `nn.GELU` that `apply` swaps for `GELU`) where its BatchNorm and GELU
  do not run as one kernel (fused_bn_gelu.py, which reads the same table): under bfloat16 autocast
  BatchNorm hands GELU a bfloat16 tensor;
- the bfloat16 training MLP (fused_mlp.py), whose fc2 backward multiplies by the kept derivative
  inside oneDNN's matmul;
- inference's GELU after fc1 (fused_linear.py), in place.

In float32, on CPUs with AVX2 and no AVX-512, native/gelu_f32_avx2.c evaluates the exact GELU from erfc
(as accurate as PyTorch's float32 kernels, and more so for negative inputs) and its backward recomputes the
derivative from the input, as PyTorch's does. Where AVX-512 runs PyTorch's 16-wide kernels, float32 keeps
F.gelu (not measured against them). The stem's GELUs and the MLP's use it. Measurements: docs/performance.md,
"GELU".

It runs on CPU tensors laid out densely (contiguous, or channels-last), where vitscope's kernels run
(`native.runnable`: not while torch.compile traces, which keeps F.gelu for Inductor to fuse, nor under
forward-mode AD or torch.func). Double backward is not supported (it raises).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native, registry


def fusable(x: Tensor) -> bool:
    """Whether `gelu(x)` may stand in for `F.gelu(x)` (exact, erf form) here."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        return False
    return registry.runnable("gelu", x.dtype, x)


def gelu_and_derivative(a: Tensor) -> tuple[Tensor, Tensor]:
    """(gelu(a), gelu'(a)), each laid out as `a` is. a: bfloat16, contiguous or channels-last."""
    h, d = torch.empty_like(a), torch.empty_like(a)  # a's strides: the pass runs in memory order
    native.library().vs_gelu_fwd(a.data_ptr(), h.data_ptr(), d.data_ptr(), a.numel(), torch.get_num_threads())
    return h, d


def _lookup(a: Tensor, out: Tensor) -> Tensor:
    """out = gelu(a) (out may be a), both bfloat16 laid out alike, contiguous or channels-last; out."""
    native.library().vs_gelu(a.data_ptr(), out.data_ptr(), a.numel(), torch.get_num_threads())
    return out


def gelu_(a: Tensor) -> Tensor:
    """a = gelu(a) in place, and a. a: bfloat16, contiguous or channels-last."""
    return _lookup(a, a)


class _Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor) -> Tensor:
        h, d = gelu_and_derivative(a)
        ctx.save_for_backward(d)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor) -> Tensor:
        (d,) = ctx.saved_tensors
        return g * d


class _GeluFloat32(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor) -> Tensor:
        ctx.save_for_backward(a)
        return _gelu_float32(a, torch.empty_like(a))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor) -> Tensor:
        (a,) = ctx.saved_tensors
        if g.stride() != a.stride():  # the kernel runs both in a's memory order
            g = torch.empty_like(a).copy_(g)
        ga = torch.empty_like(a)
        native.library().vs_gelu_f32_bwd(a.data_ptr(), g.data_ptr(), ga.data_ptr(), a.numel(), torch.get_num_threads())
        return ga


def _gelu_float32(a: Tensor, out: Tensor) -> Tensor:
    """out = gelu(a), float32 laid out alike (empty_like), in native/gelu_f32_avx2.c; out."""
    native.library().vs_gelu_f32(a.data_ptr(), out.data_ptr(), a.numel(), torch.get_num_threads())
    return out


def gelu(a: Tensor) -> Tensor:
    """F.gelu(a) from vitscope's kernels, differentiable where autograd records. Call it only where
    `fusable(a)`."""
    grad = torch.is_grad_enabled() and a.requires_grad
    if a.dtype == torch.float32:
        return _GeluFloat32.apply(a) if grad else _gelu_float32(a, torch.empty_like(a))
    if grad:
        return _Gelu.apply(a)
    return _lookup(a, torch.empty_like(a))


class GELU(nn.GELU):
    """`nn.GELU` that runs vitscope's kernels for CPU tensors where `fusable` says (bfloat16 from the table,
    float32 without AVX-512); elsewhere, and with `approximate="tanh"`, nn.GELU's own."""

    def forward(self, x: Tensor) -> Tensor:
        if self.approximate == "none" and registry.enabled() and fusable(x):
            return gelu(x)
        return F.gelu(x, approximate=self.approximate)

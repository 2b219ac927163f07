"""GELU of bfloat16 tensors on CPU from vitscope's table, with its derivative kept for training.

A bfloat16 input takes one of 65536 values, and native/gelu.c keeps GELU and its derivative for each,
computed in float64 and rounded: a pass of lookups gives the correctly rounded results (PyTorch's
bfloat16 GELU, a float32 evaluation, is an ulp off for about one element in a thousand). In training,
the pass writes GELU's output and its derivative, the derivative is kept instead of the input, and
the backward is one multiply, where PyTorch's GELU backward computes erf and exp again.

Three places use it:
- the conv stem's activation (`GELU`, which vit.ConvStem builds) where its BatchNorm and GELU do not
  run as one kernel (fused_bn_gelu.py, which reads the same table): under bfloat16 autocast
  BatchNorm hands GELU a bfloat16 tensor. On a Zen 4 EPYC, 2 threads, the quick preset's five stem
  GELUs (batch 128) took 3.5 ms forward and 5.0 backward with PyTorch's ops and 1.2 and 0.7 here
  (1.05x the training step, 1.10x inference: benchmarks/ab_kernels.py --part gelu);
- the bfloat16 training MLP (fused_mlp.py), whose fc2 backward multiplies by the kept derivative
  inside oneDNN's matmul;
- inference's GELU after fc1 (fused_linear.py), in place.

It runs on CPU tensors of bfloat16 laid out densely (contiguous, or channels-last), where vitscope's
kernels run (`native.runnable`: not while torch.compile traces, which keeps F.gelu for Inductor to
fuse, nor under forward-mode AD or torch.func). Double backward is not supported (it raises).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import native


def fusable(x: Tensor) -> bool:
    """Whether `gelu(x)` may stand in for `F.gelu(x)` (exact, erf form) here."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return False
    if not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        return False
    return native.runnable(x, isa="avx512_bf16")


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


def gelu(a: Tensor) -> Tensor:
    """F.gelu(a) from the table, differentiable where autograd records. Call it only where `fusable(a)`."""
    if torch.is_grad_enabled() and a.requires_grad:
        return _Gelu.apply(a)
    return _lookup(a, torch.empty_like(a))


class GELU(nn.GELU):
    """`nn.GELU` that takes the table's values for bfloat16 CPU tensors where `fusable` says; elsewhere,
    and with `approximate="tanh"`, nn.GELU's own."""

    def forward(self, x: Tensor) -> Tensor:
        if self.approximate == "none" and fusable(x):
            return gelu(x)
        return F.gelu(x, approximate=self.approximate)

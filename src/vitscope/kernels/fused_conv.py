"""A conv's weight gradient in vitscope's kernels, for the conv stem's channels-last training on CPU.

The forward and the input's gradient stay oneDNN's (`F.conv2d`, and `convolution_backward` asked for
the input's gradient alone); the weight's gradient gᵀ X (X the im2col matrix, never written out) is
vitscope's, in one of two kernels:

- bfloat16 (native/conv_weight_grad.c, AVX512-BF16): packs each chunk of the im2col rows straight from
  the channels-last input, float32 sums per thread, rounded once; oneDNN's bfloat16 weight gradients of
  the stem's small convs run well below its matmul speed, and at an uneven one.
- float32 (native/conv_weight_grad_f32_avx2.c, AVX2 and FMA, for the CPUs where vitscope's AVX2 float32 linear
  products run: AMD CPUs without AVX-512): reads each tap's channels in place through a list of
  the pixels inside the image, float32 sums.

Measurements: docs/performance.md, "The conv stem".

`fusable` says where it runs: a plain `nn.Conv2d` (one group, no dilation, zero padding the same on
every side, the same stride both ways, no bias) whose weight wants a gradient, outside torch.compile,
tracing, forward-mode AD and torch.func, and either a CPU input under bfloat16 autocast (or bfloat16
with a bfloat16 weight), in and out channels multiples of 32, the AVX512-BF16 kernels loaded and no
AMX (oneDNN multiplies in its tiles there); or float32 input and weight without autocast, in channels
a multiple of 16, on a CPU where the float32 kernel runs. Double backward is not supported (it raises).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import fused_linear, native, registry


def fusable(x: Tensor, conv: nn.Module) -> bool:
    """Whether `conv2d(x, conv)` may stand in for `conv(x)`, with its weight's gradient from a kernel."""
    if type(conv) is not nn.Conv2d or conv.bias is not None or conv.groups != 1 or conv.padding_mode != "zeros":
        return False
    if isinstance(conv.padding, str) or len(set(conv.padding)) != 1 or len(set(conv.stride)) != 1:
        return False
    w = conv.weight
    if conv.dilation != (1, 1) or not (w.requires_grad and torch.is_grad_enabled()):
        return False
    if x.dim() != 4 or x.shape[1] != conv.in_channels:
        return False
    if fused_linear.bfloat16_inputs(x, w):
        if conv.in_channels % 32 or conv.out_channels % 32:
            return False
        return registry.runnable("conv weight gradient", torch.bfloat16, x, w)
    if fused_linear.float32_inputs(x, w):
        return conv.in_channels % 16 == 0 and registry.runnable("conv weight gradient", torch.float32, x, w)
    return False


def conv2d(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """`conv(x)` as bfloat16 autocast (or float32) runs it, channels-last; call it only where `fusable(x, conv)`."""
    dt, cl = (torch.float32 if x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
              else torch.bfloat16), torch.channels_last
    return _Conv2d.apply(x.to(dt).contiguous(memory_format=cl), conv.weight.to(dt).contiguous(memory_format=cl),
                         conv.stride[0], conv.padding[0])


class _Conv2d(torch.autograd.Function):
    """oneDNN's forward and input gradient; the weight's gradient from vitscope's kernel for x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, stride: int, pad: int) -> Tensor:
        # x (B, C, H, W), weight (O, C, KH, KW): both bfloat16 or both float32, channels-last
        ctx.save_for_backward(x, weight)
        ctx.stride, ctx.pad = stride, pad
        with torch.autocast("cpu", enabled=False):
            return F.conv2d(x, weight, None, stride, pad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        g = grad.to(x.dtype).contiguous(memory_format=torch.channels_last)  # (B, O, OH, OW)
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.ops.aten.convolution_backward(g, x, weight, None, [ctx.stride] * 2, [ctx.pad] * 2, [1, 1],
                                                     False, [0, 0], 1, [True, False, False])[0]
        gw = None
        if ctx.needs_input_grad[1]:
            kernel = weight_grad if x.dtype == torch.bfloat16 else weight_grad_f32
            gw = kernel(g, x, weight.shape, ctx.stride, ctx.pad)
        return gx, gw, None, None


def weight_grad(g: Tensor, x: Tensor, shape: torch.Size, stride: int, pad: int) -> Tensor:
    """The weight's gradient (O, C, KH, KW), channels-last bfloat16, of a conv (one group, no dilation)
    with output gradient g (B, O, OH, OW) and input x (B, C, H, W): both bfloat16 channels-last."""
    (n, c, h, w), (o, _, kh, kw), (oh, ow) = x.shape, shape, g.shape[2:]
    threads = torch.get_num_threads()
    work = torch.empty(threads, o, kh * kw * c)
    dw = torch.empty(shape, dtype=torch.bfloat16, memory_format=torch.channels_last)
    status = native.library().vs_conv_weight_grad_bf16(g.data_ptr(), x.data_ptr(), n, h, w, c, oh, ow, o, kh, kw,
                                                       stride, pad, work.data_ptr(), dw.data_ptr(), threads)
    if status != 0:
        raise MemoryError("vitscope's conv weight-gradient kernel could not allocate its packing buffers")
    return dw


def weight_grad_f32(g: Tensor, x: Tensor, shape: torch.Size, stride: int, pad: int) -> Tensor:
    """The weight's gradient (O, C, KH, KW), channels-last float32, of a conv (one group, no dilation) with
    output gradient g (B, O, OH, OW) and input x (B, C, H, W): both float32 channels-last, C % 16 == 0."""
    (n, c, h, w), (o, _, kh, kw), (oh, ow) = x.shape, shape, g.shape[2:]
    threads = torch.get_num_threads()
    work = torch.empty(max(threads - 1, 0), o, kh * kw * c)
    dw = torch.empty(shape, memory_format=torch.channels_last)
    status = native.library().vs_conv_weight_grad_f32_avx2(g.data_ptr(), x.data_ptr(), n, h, w, c, oh, ow, o, kh,
                                                           kw, stride, pad, work.data_ptr(), dw.data_ptr(), threads)
    if status != 0:
        raise MemoryError("vitscope's float32 conv weight-gradient kernel could not allocate its buffers")
    return dw

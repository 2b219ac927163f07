"""BatchNorm then GELU, the conv stem's pair, in one C kernel each way for channels-last activations on CPU:
bfloat16 (native/batch_norm.c, AVX512-BF16), and float32 on CPUs with AVX2 and without AVX-512
(native/batch_norm_f32_avx2.c).

Under bfloat16 autocast the stem's convs write bfloat16 channels-last activations; BatchNorm reads
them twice (statistics, then normalising) and writes its output, GELU reads that and writes its own,
and the backward runs the same passes again in reverse. Here (native/batch_norm.c) the statistics take
two passes over the input and one more pass normalises, rounds to bfloat16 as BatchNorm's output would
be, and looks GELU and its derivative up in vitscope's table (fused_gelu.py); the backward takes the
BatchNorm gradient's two sums and then the input gradient, with GELU's multiply inside both. So the
step keeps the conv's output and GELU's derivative, as the two modules keep the conv's output and
BatchNorm's, and no BatchNorm output or GELU input gradient is written at all. In float32 the same passes
run with native/gelu_f32_avx2.c's exact GELU, its value and derivative from one evaluation of erfc (no
rounding between BatchNorm and GELU there, as there is none in PyTorch's float32 ops). Measurements:
docs/performance.md, "The conv stem".

Training mode uses the batch's statistics and updates the running ones as nn.BatchNorm2d does (the
momentum, or the cumulative average where it is None, the unbiased variance, num_batches_tracked);
eval mode uses the running statistics, only where no gradient is wanted. It runs where `fusable` says:
an affine nn.BatchNorm2d with float32 parameters followed by an exact nn.GELU, a CPU channels-last
input, bfloat16 with channels a multiple of 16 and the AVX512-BF16 kernels loaded, or float32 with channels
a multiple of 8 where the AVX2 kernels run and AVX-512 does not (as fused_gelu's float32 GELU), outside
torch.compile, tracing, forward-mode AD and torch.func. Double backward is not supported (it raises).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import fused_gelu, native, registry

MAX_CHANNELS = 1024  # the kernels' stack buffers


def fusable(x: Tensor, bn: nn.Module, act: nn.Module) -> bool:
    """Whether `bn_gelu(x, bn)` may stand in for `act(bn(x))`."""
    if type(bn) is not nn.BatchNorm2d or not bn.affine or bn.weight.dtype != torch.float32:
        return False
    if type(act) not in (nn.GELU, fused_gelu.GELU) or act.approximate != "none":
        return False
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 4:
        return False
    c = x.shape[1]
    if c != bn.num_features or c % (16 if x.dtype == torch.bfloat16 else 8) or c > MAX_CHANNELS:
        return False
    if not x.is_contiguous(memory_format=torch.channels_last):
        return False
    batch_stats = bn.training or bn.running_mean is None
    if batch_stats and x.numel() // c < 2:
        return False  # nn.BatchNorm2d raises its own error for one value per channel
    if not batch_stats and _wants_grad(x, bn):
        return False  # eval mode with gradients (a frozen BatchNorm being fine-tuned through): the modules
    return registry.runnable("batch norm + gelu", x.dtype, x, bn.weight, bn.bias)


_FLOAT32 = {"vs_bn_stats": "vs_bn_stats_f32", "vs_bn_gelu_fwd": "vs_bn_gelu_f32_fwd",
            "vs_bn_gelu_bwd": "vs_bn_gelu_f32_bwd"}


def _kernel(x: Tensor, name: str):
    """The C function `name` (a key of _FLOAT32, the bfloat16 kernel) for x's dtype."""
    return getattr(native.library(), _FLOAT32[name] if x.dtype == torch.float32 else name)


def _wants_grad(x: Tensor, bn: nn.Module) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or bn.weight.requires_grad or bn.bias.requires_grad)


def _batch_stats(x: Tensor, bn: nn.BatchNorm2d) -> tuple[Tensor, Tensor]:
    """The batch's mean and biased variance (C,), and the running statistics updated as nn.BatchNorm2d
    updates them in training mode."""
    c, threads = x.shape[1], torch.get_num_threads()
    rows = x.numel() // c
    mean, var = torch.empty(c), torch.empty(c)
    work = torch.empty(threads, c, dtype=torch.float64)
    _kernel(x, "vs_bn_stats")(x.data_ptr(), rows, c, work.data_ptr(), mean.data_ptr(), var.data_ptr(), threads)
    if bn.training and bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            factor = 0.0 if bn.momentum is None else bn.momentum
            if bn.num_batches_tracked is not None:
                bn.num_batches_tracked.add_(1)
                factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
            bn.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            bn.running_var.mul_(1 - factor).add_(var * (rows / (rows - 1)), alpha=factor)
    return mean, var


def _forward(x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor,
             derivative: bool) -> tuple[Tensor, Tensor | None]:
    """(gelu(bn(x)), gelu'(bn(x)) where `derivative`, else None), each channels-last as x."""
    scale = weight.detach() * rstd
    shift = bias.detach() - mean * scale
    h, d = torch.empty_like(x), (torch.empty_like(x) if derivative else None)
    _kernel(x, "vs_bn_gelu_fwd")(x.data_ptr(), x.numel() // x.shape[1], x.shape[1], scale.data_ptr(),
                                 shift.data_ptr(), h.data_ptr(), None if d is None else d.data_ptr(),
                                 torch.get_num_threads())
    return h, d


class _BnGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
        h, d = _forward(x, weight, bias, mean, rstd, derivative=True)
        ctx.save_for_backward(x, d, weight, mean, rstd)
        return h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, d, weight, mean, rstd = ctx.saved_tensors
        g = g.to(x.dtype).contiguous(memory_format=torch.channels_last)
        rows, c, threads = x.numel() // x.shape[1], x.shape[1], torch.get_num_threads()
        dx = torch.empty_like(x)
        dweight, dbias = torch.empty(c), torch.empty(c)
        work = torch.empty(threads, 2, c, dtype=torch.float64)
        _kernel(x, "vs_bn_gelu_bwd")(g.data_ptr(), d.data_ptr(), x.data_ptr(), rows, c, mean.data_ptr(),
                                     rstd.data_ptr(), weight.data_ptr(), work.data_ptr(), dweight.data_ptr(),
                                     dbias.data_ptr(), dx.data_ptr(), threads)
        return dx, dweight, dbias, None, None


def bn_gelu(x: Tensor, bn: nn.BatchNorm2d) -> Tensor:
    """gelu(bn(x)), x (B, C, H, W) bfloat16 or float32 channels-last -> the same. Call it only where `fusable`
    says."""
    if bn.training or bn.running_mean is None:
        mean, var = _batch_stats(x, bn)
    else:
        mean, var = bn.running_mean.float(), bn.running_var.float()
    rstd = (var + bn.eps).rsqrt()
    if _wants_grad(x, bn):
        return _BnGelu.apply(x, bn.weight, bn.bias, mean, rstd)
    return _forward(x, bn.weight, bn.bias, mean, rstd, derivative=False)[0]

"""Linear layers whose bias and GELU run inside oneDNN's matmul, for bfloat16 inference on CPU.

`nn.Linear` under bfloat16 autocast calls `addmm`, which first copies the bias into every row of
the output and then multiplies into it; the MLP's GELU then reads and writes the whole hidden
activation once more. oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, the kernel that
torch.compile's CPU backend emits for the same pattern) adds the bias and applies GELU to the
float32 accumulator and rounds once, in the matmul's own pass. That is also a little closer to the
exact result: the unfused path rounds to bfloat16 before the bias and again before the GELU.

The kernel has no backward, so it runs only where nothing asks for gradients (`torch.inference_mode`,
`torch.no_grad`, or inputs and weights that do not require them), on CPU tensors, in bfloat16
(under CPU autocast, or with bfloat16 input and weights), and never while torch.compile or
torch.jit.trace records a graph. In float32 it measured no faster, so float32 keeps `F.linear`.
Measured on a Xeon with AMX, 2 threads, input (12800, 128) (bench_vit.py's Fashion-MNIST shape):
128 -> 512 took 0.67 ms against nn.Linear's 0.91, and with the GELU 1.69 against 2.08. Whole bfloat16
inference forwards (benchmarks/ab_fused_linear.py, with the patch embedding run as a linear too):
1.16x on that shape, 1.20x on ViT-S/16, 1.05x on the vit_fmnist_quick preset.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_KERNEL = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


@functools.cache
def available() -> bool:
    """True where this build of torch has oneDNN's linear and the CPU runs it in bfloat16."""
    if _KERNEL is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def fusable(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` may run the fused kernel and give what `F.linear` would."""
    grads = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if grads and torch.is_grad_enabled():
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.layout != torch.strided or x.dim() < 2:
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # traced graphs keep the portable ops
        return False
    if not torch.backends.mkldnn.enabled:  # the user switched oneDNN off (torch.backends.mkldnn.flags)
        return False
    if torch.is_autocast_enabled("cpu"):
        if torch.get_autocast_dtype("cpu") != torch.bfloat16 or not x.is_floating_point():
            return False
    elif not (x.dtype == weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)):
        return False
    return available()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, gelu: bool = False) -> Tensor:
    """x (..., in) -> (..., out) in bfloat16: x Wᵀ + b, then exact (erf) GELU if `gelu`.

    Call it only where `fusable(x, weight, bias)`; it casts as bfloat16 autocast would."""
    dt = torch.bfloat16
    bias = None if bias is None else bias.to(dt)
    if gelu:
        return _KERNEL(x.to(dt), weight.to(dt), bias, "gelu", [], "none")
    return _KERNEL(x.to(dt), weight.to(dt), bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` that adds its bias inside oneDNN's matmul where `fusable` allows.

    The same parameters, state dict, hooks and gradients as `nn.Linear`; elsewhere it is `F.linear`."""

    def forward(self, x: Tensor) -> Tensor:
        if fusable(x, self.weight, self.bias):
            return linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

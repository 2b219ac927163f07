"""Linear layers whose bias and GELU run inside oneDNN's matmul, for bfloat16 inference on CPU.

`nn.Linear` under bfloat16 autocast calls `addmm`, which first copies the bias into every row of
the output and then multiplies into it; the MLP's GELU then reads and writes the whole hidden
activation once more. oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, the kernel that
torch.compile's CPU backend emits for the same pattern) adds the bias and applies GELU to the
float32 accumulator and rounds once, in the matmul's own pass. That is also a little closer to the
exact result: the unfused path rounds to bfloat16 before the bias and again before the GELU.

The kernel has no backward, so it runs only where nothing asks for gradients (`torch.inference_mode`,
`torch.no_grad`, or inputs and weights that do not require them), on CPU tensors, in bfloat16 (under
CPU autocast, or with bfloat16 input and weights), and never while torch.compile traces. Measured on
a Xeon with AMX, 2 threads, (12800, 128) input (benchmarks/bench_vit.py's Fashion-MNIST shape):
128 -> 512 took 0.67 ms against nn.Linear's 0.91, and with GELU 1.69 against 2.08; in float32
the gain was within noise (and at ViT-S/16's widths none), so float32 keeps `F.linear`.
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


def fusable(x: Tensor, layer: nn.Linear) -> bool:
    """Whether `linear(x, layer)` may run the fused kernel and give what `layer(x)` would."""
    w, b = layer.weight, layer.bias
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return False
    if x.device.type != "cpu" or w.device.type != "cpu" or x.layout != torch.strided or x.dim() < 2:
        return False
    if torch.compiler.is_compiling():
        return False
    if torch.is_autocast_enabled("cpu"):
        if torch.get_autocast_dtype("cpu") != torch.bfloat16 or not x.is_floating_point():
            return False
    elif not (x.dtype == w.dtype == torch.bfloat16 and (b is None or b.dtype == torch.bfloat16)):
        return False
    return available()


def linear(x: Tensor, layer: nn.Linear, *, gelu: bool = False) -> Tensor:
    """x (..., in) -> (..., out) in bfloat16: x Wᵀ + b, then exact (erf) GELU if `gelu`.

    Call it only where `fusable(x, layer)`; it casts as bfloat16 autocast would."""
    dt = torch.bfloat16
    bias = None if layer.bias is None else layer.bias.to(dt)
    if gelu:
        return _KERNEL(x.to(dt), layer.weight.to(dt), bias, "gelu", [], "none")
    return _KERNEL(x.to(dt), layer.weight.to(dt), bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` that adds its bias inside oneDNN's matmul where `fusable` allows.

    The same parameters, state dict, hooks and gradients as `nn.Linear`; elsewhere it is `F.linear`."""

    def forward(self, x: Tensor) -> Tensor:
        if fusable(x, self):
            return linear(x, self)
        return F.linear(x, self.weight, self.bias)

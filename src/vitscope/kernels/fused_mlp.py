"""The MLP (fc1, exact GELU, fc2) for bfloat16 training on CPU, with GELU's derivative kept instead of its input.

In training, autograd's MLP keeps fc1's output `a` for GELU's backward, which reads `a` and the
incoming gradient and computes erf and exp again, one more pass over the (B·N, hidden) activation
each way. Here the forward runs fc1 in oneDNN's linear (bias in the matmul), then vitscope's GELU
table (fused_gelu.py), which writes h = gelu(a) and d = gelu'(a) in one pass, then fc2. The backward gets
a's gradient as (g W2) ∘ d straight out of oneDNN's matmul with a multiply in its epilogue
(`_linear_pointwise.binary`), then the weight, bias and input gradients as addmm's backward computes
them. So the step keeps h and d and not a, and skips the separate GELU backward (docs/performance.md,
"The training MLP"). Where vitscope's product kernel runs (linear_bf16.py: AVX512-BF16, no AMX), it takes fc1 with the
GELU lookup in its own pass, fc2, and both backward products, the multiply by d in its epilogue.

On fused_linear's float32 path (AMD CPUs with AVX2 and no AVX-512) the same MLP runs in float32 on
vitscope's float32 product kernel (linear_f32.py): fc1's product writes gelu(a) and gelu'(a) from its own
pass (exact GELU from erfc, as fused_gelu's float32 kernel), fc2's backward product multiplies by gelu'(a)
before storing.

It runs where `fusable` says: CPU, bfloat16 (autocast or bfloat16 tensors) with oneDNN's bfloat16 linear
and vitscope's kernels available, or that float32 path; autograd recording, outside tracing, forward-mode
AD and torch.func; under torch.compile as the custom op `vitscope::mlp_bf16` (or `vitscope::mlp_f32`), which
the graph keeps. Double backward is not supported (it raises). Elsewhere the MLP keeps its modules.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import fused_gelu, fused_linear, linear_bf16, linear_f32, registry

_KERNEL = fused_linear._KERNEL


def fusable(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> bool:
    """Whether `mlp(x, w1, b1, w2, b2)` may run here (training; inference has fused_linear's GELU). While
    torch.compile traces, it runs as a custom op the graph keeps, where an earlier load found the kernels."""
    if not (fused_linear.needs_grad(x, w1, b1) or fused_linear.needs_grad(x, w2, b2)):
        return False
    if torch.compiler.is_compiling():
        if fused_linear.float32_inputs(x, w1, b1) and fused_linear.float32_inputs(x, w2, b2):
            return registry.isa("mlp", torch.float32) is not None and _float32_widths(x, w1, b1, w2, b2)
        return (_KERNEL is not None and hasattr(_KERNEL, "binary") and fused_linear.bfloat16_inputs(x, w1, b1)
                and fused_linear.bfloat16_inputs(x, w2, b2) and registry.isa("mlp", torch.bfloat16) is not None)
    if x.dtype == torch.float32 and fused_linear.float32_fusable(x, w1, b1):
        return _float32_fusable(x, w1, b1, w2, b2) and registry.runnable("mlp", torch.float32, x, w1, b1, w2, b2)
    if not (fused_linear.fusable(x, w1, b1) and fused_linear.fusable(x, w2, b2)):
        return False
    return hasattr(_KERNEL, "binary") and registry.runnable("mlp", torch.bfloat16, x, w1, b1, w2, b2)


def _float32_fusable(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> bool:
    """On fused_linear's float32 path, whether linear_f32's kernel takes all six products of `mlp`: fc1 with
    its GELU, fc2, and the backward's (widths multiples of 8, matching shapes; float32 throughout)."""
    if not fused_linear.float32_fusable(x, w2, b2) or x.shape[-1] != w1.shape[1] or w1.shape[0] != w2.shape[1]:
        return False
    # a row each of x (M, in) and of the hidden activation (M, hidden) stand for them: the checks look at widths
    # (mlp hands the kernels x's rows with unit stride)
    row, hidden = x.new_empty(1, x.shape[-1]), x.new_empty(1, w1.shape[0])
    return (linear_f32.runnable(row, w1, b1) and linear_f32.runnable(hidden, w2, b2)
            and linear_f32.runnable(hidden, w1, forward=False) and linear_f32.usable(x))


def _float32_widths(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> bool:
    """The shapes linear_f32's kernel takes for all six products of `mlp` (as `linear_f32.runnable` checks
    them eagerly): x (..., in), w1 (hidden, in), w2 (out, hidden), biases of hidden and out values, in,
    hidden and out multiples of 8."""
    hidden, inner = w1.shape if w1.dim() == 2 else (0, 0)
    if w2.dim() != 2 or x.dim() < 2 or x.shape[-1] != inner or w2.shape[1] != hidden or x.numel() == 0:
        return False
    if (b1 is not None and b1.shape != (hidden,)) or (b2 is not None and b2.shape != (w2.shape[0],)):
        return False
    return inner > 0 and hidden > 0 and inner % 8 == 0 and hidden % 8 == 0 and w2.shape[0] % 8 == 0


def _forward(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(y (..., out), h (M, hidden), d (M, hidden)): the output, and GELU's output and derivative, kept
    for the backward instead of fc1's output."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, in)
    if x2.dtype == torch.float32:
        h, d = linear_f32.forward_gelu(x2, w1, b1)  # (M, hidden) each, in the product's own pass
    elif linear_bf16.runnable(x2, w1, b1):
        h, d = linear_bf16.forward_gelu(x2, w1, b1)  # (M, hidden) each, from the product's own pass
    else:
        h, d = fused_gelu.gelu_and_derivative(_KERNEL(x2, w1, b1, "none", [], ""))  # (M, hidden) each
    y = fused_linear.product(h, w2, b2)  # (M, out)
    return y.view(*x.shape[:-1], y.shape[-1]), h, d


def _backward(g: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor, d: Tensor,
              needs: list[bool]) -> list[Tensor | None]:
    """[gx, gw1, gb1, gw2, gb2], each None where `needs` (in that order) says it is not wanted."""
    g = g.reshape(-1, g.shape[-1]).to(h.dtype)  # (M, out)
    if g.stride(-1) != 1 or g.stride(0) != g.shape[-1]:
        g = g.contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    need_x, need_w1, need_b1, need_w2, need_b2 = needs
    gx = gw1 = gb1 = None
    gw2, gb2 = fused_linear.weight_and_bias_grad(g, h, need_b2, weight=need_w2)  # (out, hidden), (out,)
    if need_x or need_w1 or need_b1:
        if g.dtype == torch.float32:
            ga = linear_f32.input_grad(g, w2, mul=d)  # (g W2) ∘ gelu'(a): (M, hidden)
        elif linear_bf16.runnable(g, w2, forward=False):
            ga = linear_bf16.input_grad(g, w2, mul=d)  # (g W2) ∘ gelu'(a): (M, hidden)
        else:
            ga = _KERNEL.binary(g, d, w2.t(), None, "mul")  # the same in oneDNN; W2ᵀ as a view
        if need_x:
            gx = fused_linear.input_grad(ga, w1).view(x.shape)
        gw1, gb1 = fused_linear.weight_and_bias_grad(ga, x2, need_b1, weight=need_w1)
    return [gx, gw1, gb1, gw2, gb2]


def _save(ctx, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, h: Tensor,
          d: Tensor) -> None:
    """Keeps what the backward needs, for the autograd function and the custom op alike: h and d are
    intermediates, kept instead of fc1's output."""
    ctx.save_for_backward(x, w1, w2, h, d)
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None


def _needs(ctx) -> list[bool]:
    n = ctx.needs_input_grad
    return [n[0], n[1], n[2] and ctx.has_b1, n[3], n[4] and ctx.has_b2]


class _Mlp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> Tensor:
        y, h, d = _forward(x, w1, b1, w2, b2)
        _save(ctx, x, w1, b1, w2, b2, h, d)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        return tuple(_backward(g, *ctx.saved_tensors, _needs(ctx)))


# The same as torch.library custom ops, which a torch.compile graph keeps whole: under compile the
# graph then runs oneDNN's fused linears, the C GELU pass and the multiply in fc2's backward as the
# eager step does; in float32 (`vitscope::mlp_f32`) the float32 products with their GELU epilogues, as
# eager. Inductor's own lowering of this MLP is slower in both (docs/performance.md, "The training MLP").
def _op_impl(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    y, h, d = _forward(x, w1, b1, w2, b2)
    return y.clone() if y._base is not None else y, h, d  # an op's outputs may not be views of each other


def _op_fake(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    m = x.numel() // x.shape[-1]  # x already in the op's dtype (bfloat16 or float32)
    return x.new_empty(*x.shape[:-1], w2.shape[0]), x.new_empty(m, w1.shape[0]), x.new_empty(m, w1.shape[0])


def _backward_impl(g: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor, d: Tensor,
                   needs: list[bool]) -> list[Tensor]:
    return [x.new_empty(0) if t is None else t.contiguous() for t in _backward(g, x, w1, w2, h, d, needs)]


def _backward_fake(g: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor, d: Tensor,
                   needs: list[bool]) -> list[Tensor]:
    shapes = (x.shape, w1.shape, w1.shape[:1], w2.shape, w2.shape[:1])
    return [x.new_empty(s if n else (0,), dtype=h.dtype) for s, n in zip(shapes, needs)]


def _op_setup_context(ctx, inputs, output) -> None:
    _, h, d = output
    _save(ctx, *inputs, h, d)


def _custom_ops(name: str):
    """The forward op `vitscope::{name}` and its backward op, with the autograd rule joining them."""
    forward = torch.library.custom_op(f"vitscope::{name}", _op_impl, mutates_args=(), device_types="cpu")
    backward = torch.library.custom_op(f"vitscope::{name}_backward", _backward_impl, mutates_args=(),
                                       device_types="cpu")
    forward.register_fake(_op_fake)
    backward.register_fake(_backward_fake)

    def op_backward(ctx, g: Tensor, _h_grad: Tensor, _d_grad: Tensor):
        needs = _needs(ctx)
        grads = backward(g, *ctx.saved_tensors, needs)
        return tuple(t if need else None for t, need in zip(grads, needs))

    forward.register_autograd(op_backward, setup_context=_op_setup_context)
    return forward


_op = _custom_ops("mlp_bf16")
_op_f32 = _custom_ops("mlp_f32")


def mlp(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> Tensor:
    """fc2(gelu(fc1(x))) in bfloat16 (or float32 on fused_linear's float32 path, float32 tensors), x (..., in)
    -> (..., out). Call it only where `fusable` says."""
    if x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"):
        x = x if x.stride(-1) == 1 else x.contiguous()
        return (_op_f32(x, w1, b1, w2, b2)[0] if torch.compiler.is_compiling() else _Mlp.apply(x, w1, b1, w2, b2))
    dt = torch.bfloat16
    x, w1, w2 = x.to(dt), w1.to(dt), w2.to(dt)
    b1 = None if b1 is None else b1.to(dt)
    b2 = None if b2 is None else b2.to(dt)
    if torch.compiler.is_compiling():
        return _op(x, w1, b1, w2, b2)[0]
    return _Mlp.apply(x, w1, b1, w2, b2)

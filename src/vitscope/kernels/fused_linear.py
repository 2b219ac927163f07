"""Linear layers whose bias (and, in inference, GELU) run inside oneDNN's matmul, for bfloat16 on CPU.

`nn.Linear` under bfloat16 autocast calls `addmm`, which first copies the bias into every row of
the output and then multiplies into it; the MLP's GELU then reads and writes the whole hidden
activation once more. oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, the kernel that
torch.compile's CPU backend emits for the same pattern) adds the bias and applies GELU to the
float32 accumulator and rounds once, in the matmul's own pass. That is also a little closer to the
exact result: the unfused path rounds to bfloat16 before the GELU. Where vitscope's C kernels run,
inference's GELU is instead a pass right after the matmul that looks it up in a table (`_linear_gelu`:
faster than oneDNN's erf, and the unfused path's numbers, correctly rounded).

The kernel has no backward of its own. Where autograd records the call (training), `linear` wraps it
in an autograd function whose backward is addmm's (x's gradient g W, the weight's gᵀ x, the bias's
the column sums of g, each only if asked for), so gradients are the same numbers (up to the order of
float32 sums where `weight_and_bias_grad` runs vitscope's kernel); the GELU then stays
a separate op, since its backward needs fc1's output before it. Calls that forward-mode AD or
torch.func transform keep `F.linear`. The kernel runs on CPU tensors, in bfloat16 (under CPU
autocast, or with bfloat16 input and weights), and never while torch.compile or torch.jit.trace
records a graph. In float32 it is no faster where torch's float32 matmul is MKL's tuned path (a Xeon
with AMX), but on AMD CPUs without AVX-512 MKL takes a generic path and oneDNN's float32 linear is faster
forward and for the input gradient (`float32_fusable`, below); there vitscope's own AVX2 kernel
(linear_f32.py) takes all three products, the weight and bias gradients too, where it runs. On CPUs with
AVX512-BF16 and no AMX, vitscope's own product kernel (linear_bf16.py) takes the forward, the GELU
and the input gradient in place of oneDNN's where it runs (`product`, `input_grad`).

Measurements: docs/performance.md, "Linear layers in bfloat16".
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitscope.kernels import fused_gelu, linear_bf16, linear_f32, native, registry

_KERNEL = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def available() -> bool:
    """True where this build of torch has oneDNN's linear and the CPU runs it in bfloat16 (the registry's
    "linear" kernel for bfloat16)."""
    return registry.runs("linear", torch.bfloat16) is not None


@functools.cache
def float32_available() -> bool:
    """True where float32 linear layers run faster through oneDNN than through torch's default (MKL's sgemm):
    AMD CPUs (`registry.amd`). Without AVX-512 (Zen 2, Zen 3) MKL takes a generic path and the weight gradient
    gᵀ x stays out of it (oneDNN's is slower there); with it (Zen 5 measured, Zen 4 taken to be alike) oneDNN's
    products run at 2.3x MKL's forward and 1.2-1.7x for gᵀ x. Other CPUs keep F.linear: on a Xeon with AMX
    oneDNN measured no faster, and Intel's AVX2 and AVX-512 parts without AMX have not been measured
    (docs/performance.md, "Linear layers in float32 on AMD CPUs")."""
    return _KERNEL is not None and registry.onednn_linear() and registry.amd()


def float32_fusable(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether `linear_float32(x, weight, bias)` may run here and give what `F.linear` would (to float32
    rounding), with or without autograd recording it: as `fusable`, for `float32_inputs` where
    `float32_available()`."""
    return _callable(x, weight, bias, float32_inputs(x, weight, bias)) and float32_available()


def needs_grad(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether autograd will record `linear(x, weight, bias)`."""
    wants = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return wants and torch.is_grad_enabled()


def _cpu_onednn(x: Tensor, weight: Tensor) -> bool:
    """CPU tensors in the strided layout, x with rows, and oneDNN not switched off by the user
    (torch.backends.mkldnn.flags)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.layout == torch.strided and x.dim() >= 2
            and torch.backends.mkldnn.enabled)


def bfloat16_inputs(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether `x Wᵀ + b` runs in bfloat16 on the CPU here, through oneDNN: CPU tensors, oneDNN switched
    on, and bfloat16 autocast (or bfloat16 tensors without it). Safe to ask while torch.compile traces."""
    if not _cpu_onednn(x, weight):
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") == torch.bfloat16 and x.is_floating_point()
    return x.dtype == weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)


def float32_inputs(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether `x Wᵀ + b` runs in float32 on the CPU here: CPU tensors, oneDNN switched on, float32
    tensors and no autocast."""
    return (_cpu_onednn(x, weight) and not torch.is_autocast_enabled("cpu")
            and x.dtype == weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32))


def _callable(x: Tensor, weight: Tensor, bias: Tensor | None, inputs_ok: bool) -> bool:
    """What both oneDNN paths need besides their dtype and CPU: no torch.compile or jit trace recording
    (traced graphs keep the portable ops), and where autograd records, no forward-mode dual or
    torch.func-wrapped tensor (their autograd functions have no rules for those)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or not inputs_ok:
        return False
    return not (needs_grad(x, weight, bias) and any(native.transformed(t) for t in (x, weight, bias)))


def fusable(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` may run the fused kernel and give what `F.linear` would, with or
    without autograd recording it."""
    return _callable(x, weight, bias, bfloat16_inputs(x, weight, bias)) and available()


NATIVE_WEIGHT_GRAD_MAX = 65536  # out·in: native/weight_grad.c keeps each thread's float32 sums in cache


def _native_weight_grad(g: Tensor, x: Tensor) -> bool:
    """Whether native/weight_grad.c takes gᵀ x: bfloat16 rows with unit stride, out % 32 == 0,
    in % 64 == 0, out·in at most NATIVE_WEIGHT_GRAD_MAX, the kernels runnable here, and no AMX."""

    if g.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or g.dim() != 2 or x.dim() != 2:
        return False
    (m, out), (_, inp) = g.shape, x.shape
    if g.stride(1) != 1 or x.stride(1) != 1 or m == 0 or out % 32 or inp % 64 or out * inp > NATIVE_WEIGHT_GRAD_MAX:
        return False
    return registry.runnable("linear weight gradient", torch.bfloat16, g, x)


def weight_grad(g: Tensor, x: Tensor) -> Tensor:
    """gᵀ x, g (M, out) and x (M, in) -> (out, in): a linear layer's weight gradient.

    For small bfloat16 outputs (out·in up to 65536, the 28×28 ViTs' layers) where vitscope's kernels
    run on a CPU without AMX, native/weight_grad.c: float32 sums per thread over its share of the rows,
    rounded once. Otherwise oneDNN's matmul, which reads both operands transposed at a speed that depends
    on the output's shape, so the product is taken with the narrower output: xᵀ g, transposed back, when
    in > out (docs/performance.md, "Linear layers in bfloat16" and "Small linear layers' weight
    gradients")."""
    return weight_and_bias_grad(g, x, bias=False)[0]


def weight_and_bias_grad(g: Tensor, x: Tensor, bias: bool,
                         weight: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """(gᵀ x where `weight`, g's column sums where `bias`; None for what is not asked): a linear layer's
    weight and bias gradients. In float32 on the float32 path, vitscope's AVX2 kernel takes both where it
    runs (linear_f32.py). Where native/weight_grad.c takes the product (`_native_weight_grad`) it
    sums g's columns from the chunks it packs, in float32 and then float64 (g.sum(0): a pass of its own,
    0.3-0.75 ms at 12800 x 512)."""
    if not weight:
        return None, (g.sum(0) if bias else None)

    if g.dtype == torch.float32 and float32_available() and linear_f32.weight_grad_runnable(g, x):
        return linear_f32.weight_and_bias_grad(g, x, bias)
    if _native_weight_grad(g, x):

        (m, out), inp, threads = g.shape, x.shape[1], torch.get_num_threads()
        work = torch.empty(threads, out, inp)
        dw = torch.empty(out, inp, dtype=torch.bfloat16)
        bwork = torch.empty(threads, out, dtype=torch.float64) if bias else None
        db = torch.empty(out, dtype=torch.bfloat16) if bias else None
        status = native.library().vs_weight_grad_bf16(
            g.data_ptr(), g.stride(0), x.data_ptr(), x.stride(0), m, out, inp, work.data_ptr(), dw.data_ptr(),
            None if bwork is None else bwork.data_ptr(), None if db is None else db.data_ptr(), threads)
        if status != 0:
            raise MemoryError("vitscope's weight-gradient kernel could not allocate its packing buffers")
        return dw, db
    if (g.dtype == torch.float32 and float32_available() and not registry.amd_without_avx512()
            and g.shape[0] >= FLOAT32_WEIGHT_GRAD_MIN_ROWS):
        return _float32_weight_grad(g, x), (g.sum(0) if bias else None)
    return _onednn_weight_grad(g, x), (g.sum(0) if bias else None)


# Below this many rows MKL's gᵀ x was the faster on a Zen 5 (0.65-0.92x at 32 rows; bench_linear_f32.py)
FLOAT32_WEIGHT_GRAD_MIN_ROWS = 256


def _float32_weight_grad(g: Tensor, x: Tensor) -> Tensor:
    """gᵀ x in oneDNN's float32 product, for AMD CPUs with AVX-512 (MKL's ran at 100-107 GFLOP/s on a Zen 5,
    oneDNN's at 120-190): like `_onednn_weight_grad`, the product with the narrower output."""
    if g.shape[1] > x.shape[1]:
        return _KERNEL(x.t(), g.t(), None, "none", [], "").t().contiguous()
    return _KERNEL(g.t(), x.t(), None, "none", [], "")


def _onednn_weight_grad(g: Tensor, x: Tensor) -> Tensor:
    if x.shape[-1] > g.shape[-1]:
        return (x.t() @ g).t().contiguous()
    return g.t() @ x


def _rows(x: Tensor) -> Tensor:
    """x (..., in) as (M, in)."""
    return x.reshape(-1, x.shape[-1])


def product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., in) Wᵀ + b for bfloat16 tensors, or float32 ones on the float32 path: vitscope's kernel where
    it runs (linear_bf16.py, linear_f32.py), else oneDNN's linear."""

    x2 = _rows(x)
    if linear_bf16.runnable(x2, weight, bias):
        return linear_bf16.forward(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
    if x2.dtype == torch.float32 and linear_f32.runnable(x2, weight, bias):
        return linear_f32.forward(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return _KERNEL(x, weight, bias, "none", [], "")


def input_grad(g: Tensor, weight: Tensor) -> Tensor:
    """g (M, out) W: (M, in), a linear layer's input gradient, in vitscope's kernel where it runs, else
    torch's matmul."""

    if linear_bf16.runnable(g, weight, forward=False):
        return linear_bf16.input_grad(g, weight)
    if g.dtype == torch.float32 and float32_available():
        if linear_f32.runnable(g, weight, forward=False):
            return linear_f32.input_grad(g, weight)
        return _KERNEL(g, weight.t(), None, "none", [], "")  # oneDNN reads Wᵀ in place: (M, out) -> (M, in)
    return g @ weight


class _LinearWithGrad(torch.autograd.Function):
    """The fused kernel forward (bias inside the matmul); the backward is AddmmBackward's matmuls."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        # ctx in forward, not a separate setup_context: Function.apply binds the arguments by
        # inspect.signature on every call where setup_context is defined (torch.func transforms need it,
        # and `fusable` keeps them off this path)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        return _backward(grad, x, weight, _needs(ctx))


def _needs(ctx) -> list[bool]:
    """Which of (x, weight, bias) want a gradient."""
    n = ctx.needs_input_grad
    return [n[0], n[1], ctx.has_bias and n[2]]


def _backward(grad: Tensor, x: Tensor, weight: Tensor, needs: list[bool]) -> tuple[Tensor | None, ...]:
    """(gx, gw, gb) of x (..., in) Wᵀ + b for the output's gradient, each None where `needs` says not wanted."""
    g = grad.reshape(-1, grad.shape[-1])  # (M, out), M = all leading dims
    gx = input_grad(g, weight).view(x.shape) if needs[0] else None  # (M, in)
    gw, gb = weight_and_bias_grad(g, x.reshape(-1, x.shape[-1]), needs[2], weight=needs[1])
    return gx, gw, gb


# The float32 linear as a torch.library custom op, which a torch.compile graph keeps whole: compiled, the
# layers then run the float32 path's products (vitscope's AVX2 kernels, or oneDNN's linear) as eager does,
# where Inductor would call MKL's generic matmul (see `compiled_float32`).
@torch.library.custom_op("vitscope::linear_f32", mutates_args=(), device_types="cpu")
def _float32_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return product(x, weight, bias)


@_float32_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("vitscope::linear_f32_backward", mutates_args=(), device_types="cpu")
def _float32_backward_op(g: Tensor, x: Tensor, weight: Tensor, needs: list[bool]) -> list[Tensor]:
    return [x.new_empty(0) if t is None else t.contiguous() for t in _backward(g, x, weight, needs)]


@_float32_backward_op.register_fake
def _(g: Tensor, x: Tensor, weight: Tensor, needs: list[bool]) -> list[Tensor]:
    return [x.new_empty(s if n else (0,)) for s, n in zip((x.shape, weight.shape, weight.shape[:1]), needs)]


def _float32_setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _float32_op_backward(ctx, g: Tensor):
    x, weight = ctx.saved_tensors
    needs = _needs(ctx)
    grads = _float32_backward_op(g, x, weight, needs)
    return tuple(t if need else None for t, need in zip(grads, needs))


_float32_op.register_autograd(_float32_op_backward, setup_context=_float32_setup_context)


def float32_kernels() -> bool:
    """Whether the float32 path runs vitscope's AVX2 products here (`float32_available`, AVX2 and no AVX-512):
    asked while torch.compile traces, where `linear_f32.runnable` says no to everything."""

    return float32_available() and registry.isa("linear", torch.float32) is not None


# as native.has: Dynamo calls it while tracing and keeps the answer as a constant
float32_kernels._dynamo_marked_constant = True  # type: ignore[attr-defined]


def compiled_float32(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """While torch.compile traces: whether `Linear` runs as the custom op `vitscope::linear_f32` (float32
    tensors without autocast, on a CPU where `float32_kernels`; a weight (out, in) and x (..., in))."""
    return (torch.compiler.is_compiling() and float32_inputs(x, weight, bias) and float32_kernels()
            and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and (bias is None or bias.shape == weight.shape[:1]))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, gelu: bool = False) -> Tensor:
    """x (..., in) -> (..., out) in bfloat16: x Wᵀ + b, then exact (erf) GELU if `gelu`.

    Call it only where `fusable(x, weight, bias)`; it casts as bfloat16 autocast would. Where autograd
    records the call, the GELU cannot be fused (its backward needs the pre-activation) and `gelu`
    must be False."""
    dt = torch.bfloat16
    x, weight = x.to(dt), weight.to(dt)
    bias = None if bias is None else bias.to(dt)
    if needs_grad(x, weight, bias):
        if gelu:
            raise ValueError("fused_linear.linear: gelu=True is for inference only; apply F.gelu after it")
        return _LinearWithGrad.apply(x, weight, bias)
    if gelu:
        return _linear_gelu(x, weight, bias)
    return product(x, weight, bias)


def linear_float32(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) -> (..., out) = x Wᵀ + b in float32: vitscope's AVX2 kernel (linear_f32.py) where it runs,
    else oneDNN's linear; where autograd records, the backward's input gradient the same way and the weight and
    bias gradients in the kernel or torch's matmul. Call it only where `float32_fusable(x, weight, bias)`.
    (oneDNN's erf GELU epilogue measured slower than the matmul and a separate GELU in float32, so GELU stays
    separate.)"""
    if needs_grad(x, weight, bias):
        return _LinearWithGrad.apply(x, weight, bias)
    return product(x, weight, bias)


def _linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """gelu(x Wᵀ + b) in inference. Where vitscope's kernels run, the matmul writes x Wᵀ + b and a pass
    looks GELU up per bfloat16 value in a table of the float64 results, rounded (native/gelu.c): faster
    than oneDNN's erf GELU in the matmul's epilogue (docs/performance.md, "Linear layers in bfloat16").
    Elsewhere the epilogue, which applies GELU to the float32 sum before rounding."""

    x2 = _rows(x)
    if linear_bf16.runnable(x2, weight, bias):
        return linear_bf16.forward(x2, weight, bias, gelu=True).view(*x.shape[:-1], weight.shape[0])
    if not registry.runnable("gelu", torch.bfloat16, x):
        return _KERNEL(x, weight, bias, "gelu", [], "none")
    return fused_gelu.gelu_(_KERNEL(x, weight, bias, "none", [], ""))


class Linear(nn.Linear):
    """`nn.Linear` that adds its bias inside oneDNN's matmul where `fusable` allows, in inference and training,
    and runs float32 through vitscope's kernels or oneDNN where `float32_fusable` says they are faster (under
    torch.compile as the custom op `vitscope::linear_f32`, where `compiled_float32` says).

    The same parameters, state dict, hooks and gradients as `nn.Linear`; elsewhere it is `F.linear`."""

    def forward(self, x: Tensor) -> Tensor:
        if not x.is_cpu or not registry.enabled() or x.shape[-1] != self.in_features:  # else F.linear's message
            return F.linear(x, self.weight, self.bias)
        if fusable(x, self.weight, self.bias):
            return linear(x, self.weight, self.bias)
        if float32_fusable(x, self.weight, self.bias):
            return linear_float32(x, self.weight, self.bias)
        if compiled_float32(x, self.weight, self.bias):
            return _float32_op(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

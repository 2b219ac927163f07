"""vitscope's float32 linear products on CPUs with AVX2 and without AVX-512 (native/linear_f32_avx2.c).

A linear layer's three products: the forward x Wᵀ + b (`forward`; with the GELU's value and derivative in
the same pass, `forward_gelu`, for fused_mlp's training MLP), the input gradient g W (`input_grad`, optionally
times GELU's derivative) and the weight and bias gradients gᵀ x and g's column sums (`weight_and_bias_grad`).
fused_linear's float32 path (`fused_linear.float32_fusable`: AMD CPUs with AVX2 and no AVX-512, where MKL's
sgemm takes a generic path) calls them in place of oneDNN's and MKL's products wherever `runnable` says they
may run. The sums are float32, in another order than MKL's or oneDNN's: results agree to float32 rounding,
not bit for bit. Measurements: docs/performance.md, "Linear layers in float32 on AMD CPUs".
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native, registry


def _matrix(t: Tensor) -> bool:
    """A float32 CPU matrix with unit stride along its rows."""
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.layout == torch.strided and t.dim() == 2
            and t.stride(1) == 1)


def usable(*tensors: Tensor | None) -> bool:
    """The AVX2 kernels may run on these tensors now: the registry's float32 "linear" runs here (AMD CPUs with
    AVX2 and no AVX-512, whose 16-wide kernels in MKL and oneDNN this 8-wide one would not beat)."""
    return registry.runnable("linear", torch.float32, *tensors)


def runnable(x: Tensor, w: Tensor, bias: Tensor | None = None, *, forward: bool = True) -> bool:
    """Whether the kernel may take x (M, k) times the weight w (out, in): the forward x Wᵀ (+ bias) where
    k = in, or with `forward` False the input gradient x W where k = out. float32 CPU matrices with unit stride
    along rows, a bias of `out` float32 values, the product's columns (out forward, in backward) a multiple
    of 8, M and k not zero. A mismatch leaves the call to torch, whose error names it."""
    if not (_matrix(x) and _matrix(w)) or x.shape[0] == 0:
        return False
    k, n = (w.shape[1], w.shape[0]) if forward else (w.shape[0], w.shape[1])
    if x.shape[1] != k or k == 0 or n % 8:
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.shape != (n,)):
        return False
    return usable(x, w, bias)


def _product(x: Tensor, w: Tensor, weight_rows: bool, n: int, bias: Tensor | None, mul: Tensor | None = None,
             gelu: bool = False) -> tuple[Tensor, Tensor | None]:
    (m, k), threads = x.shape, torch.get_num_threads()
    y = torch.empty(m, n)
    d = torch.empty(m, n) if gelu else None
    packed = torch.empty(16 * k * ((n + 15) // 16))
    b = None if bias is None else bias.contiguous()
    if mul is not None:
        if mul.shape != (m, n):
            raise ValueError(f"linear_f32: the multiplier is {tuple(mul.shape)}, the product ({m}, {n})")
        if mul.dtype != torch.float32 or mul.stride(1) != 1:
            mul = mul.float().contiguous()
    native.library().vs_linear_f32_avx2(
        x.data_ptr(), x.stride(0), m, k, w.data_ptr(), w.stride(0), int(weight_rows), n,
        None if b is None else b.data_ptr(), None if mul is None else mul.data_ptr(),
        0 if mul is None else mul.stride(0), None if d is None else d.data_ptr(), y.data_ptr(), n,
        packed.data_ptr(), threads)
    return y, d


def forward(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (M, in) Wᵀ + b with w (out, in): (M, out). Call it only where `runnable(x, w, bias)`."""
    return _product(x, w, True, w.shape[0], bias)[0]


def forward_gelu(x: Tensor, w: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(gelu(a), gelu'(a)) for a = x (M, in) Wᵀ + b, each (M, out), from the product's own pass while its
    rows are in cache (exact GELU from erfc, native/normal_avx2.h: as fused_gelu's float32 kernel). Call it
    only where `runnable(x, w, bias)`."""
    h, d = _product(x, w, True, w.shape[0], bias, gelu=True)
    return h, d


def input_grad(g: Tensor, w: Tensor, mul: Tensor | None = None) -> Tensor:
    """g (M, out) W with w (out, in): (M, in), times `mul` (M, in) where given (fc2's backward: GELU's
    derivative). Call it only where `runnable(g, w, forward=False)`."""
    return _product(g, w, False, w.shape[1], None, mul)[0]


def weight_grad_runnable(g: Tensor, x: Tensor) -> bool:
    """Whether `weight_and_bias_grad(g, x, ...)` may run: float32 CPU matrices with unit stride along rows,
    g (M, out) and x (M, in) with the same M (not zero), in a multiple of 8."""
    if not (_matrix(g) and _matrix(x)) or g.shape[0] != x.shape[0] or g.shape[0] == 0:
        return False
    return g.shape[1] > 0 and x.shape[1] > 0 and x.shape[1] % 8 == 0 and usable(g, x)


def weight_and_bias_grad(g: Tensor, x: Tensor, bias: bool) -> tuple[Tensor, Tensor | None]:
    """(gᵀ x, g's column sums where `bias`, else None) for g (M, out) and x (M, in): a linear layer's weight
    (out, in) and bias (out) gradients, the column sums in float64 across chunks of rows. Call it only where
    `weight_grad_runnable(g, x)`."""
    (m, out), inp, threads = g.shape, x.shape[1], torch.get_num_threads()
    dw = torch.empty(out, inp)
    work = torch.empty(max(threads - 1, 0) * out * inp)
    bwork = torch.empty(threads * out, dtype=torch.float64) if bias else None
    db = torch.empty(out) if bias else None
    status = native.library().vs_weight_grad_f32_avx2(
        g.data_ptr(), g.stride(0), x.data_ptr(), x.stride(0), m, out, inp, work.data_ptr(), dw.data_ptr(),
        None if bwork is None else bwork.data_ptr(), None if db is None else db.data_ptr(), threads)
    if status != 0:
        raise MemoryError("vitscope's float32 weight-gradient kernel could not allocate its packing buffer")
    return dw, db

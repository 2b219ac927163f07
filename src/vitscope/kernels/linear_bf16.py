"""vitscope's bfloat16 linear products on CPUs with AVX512-BF16 and without AMX (native/linear.c).

Three products use it: a linear layer's forward x Wᵀ + b (`forward`), with fc1's GELU and its derivative
looked up from the rounded sums in the same pass (`forward_gelu`, for fused_mlp; `forward(gelu=True)` in
inference), and the input gradient g W (`input_grad`), with the multiply by GELU's derivative in the same pass
(`mul=d`, fc2's backward). Each sum is taken in float32 and rounded to bfloat16 once, as oneDNN's are; the
order of the sums differs. Measurements: docs/performance.md, "Linear products without AMX".

Where the CPU has AMX, oneDNN multiplies in its tiles at several times this kernel's peak, so it stays.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native, registry

MAX_K = 4096  # the longest reduction the kernel takes: measured up to 1536 (ViT-S/16's fc2)


def runnable(x: Tensor, w: Tensor, bias: Tensor | None = None, *, forward: bool = True) -> bool:
    """Whether the kernel may take x (M, k) times the weight w (out, in): the forward x Wᵀ (+ bias) where
    k = in, or with `forward` False the input gradient x W where k = out. bfloat16 CPU tensors of 2
    dimensions with unit stride along rows and matching sizes (a bias of `out` values), k even and at most
    MAX_K, the kernels runnable here, and no AMX. A mismatch leaves the call to oneDNN, whose error names it."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.dim() != 2 or w.dim() != 2:
        return False
    if x.device.type != "cpu" or w.device.type != "cpu" or x.layout != torch.strided or w.layout != torch.strided:
        return False
    k = x.shape[1]
    if k != (w.shape[1] if forward else w.shape[0]):
        return False
    if bias is not None and (bias.device.type != "cpu" or bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        return False
    if x.stride(1) != 1 or w.stride(1) != 1 or k % 2 or not 0 < k <= MAX_K or x.shape[0] == 0:
        return False
    return registry.runnable("linear product", torch.bfloat16, x, w, bias)


def pack(w: Tensor) -> Tensor:
    """The weight w (out, in) bfloat16 as the forward reads it, (in/2 · out + 16,) int32: each pair of input
    columns of an output row as one dword, for `forward(..., packed=)` where many calls read one weight."""
    pairs = w.contiguous().view(torch.int32).t()  # (in/2, out): dword [p, j] = w[j, 2p] | w[j, 2p + 1] << 16
    return torch.cat([pairs.reshape(-1), pairs.new_zeros(16)])


def _call(x: Tensor, k: int, w: Tensor, weight_rows: bool, n: int, bias: Tensor | None, mul: Tensor | None,
          gelu: bool = False, derivative: bool = False, packed: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    d = torch.empty(m, n, dtype=torch.bfloat16) if derivative else None
    given = packed is not None  # the weight packed by `pack`: the kernel reads it as it is
    packed = packed if given else torch.empty(k // 2 * n + 16, dtype=torch.int32)
    b = None if bias is None else bias.float().contiguous()  # no copy where it already is (a caller's kept one)
    if mul is not None:
        if mul.shape != (m, n):
            raise ValueError(f"linear_bf16: the multiplier is {tuple(mul.shape)}, the product ({m}, {n})")
        if mul.dtype != torch.bfloat16 or mul.stride(1) != 1:
            mul = mul.to(torch.bfloat16).contiguous()
    native.library().vs_linear_bf16(
        x.data_ptr(), x.stride(0), m, k, None if given else w.data_ptr(), w.stride(0), int(weight_rows), n,
        None if b is None else b.data_ptr(), None if mul is None else mul.data_ptr(),
        0 if mul is None else mul.stride(0), y.data_ptr(), n, int(gelu), None if d is None else d.data_ptr(),
        packed.data_ptr(), torch.get_num_threads())
    return y, d


def forward(x: Tensor, w: Tensor, bias: Tensor | None = None, *, gelu: bool = False,
            packed: Tensor | None = None) -> Tensor:
    """x (M, in) Wᵀ + b with w (out, in): (M, out) bfloat16; with `gelu`, gelu of that (rounded to
    bfloat16 first, as fused_gelu's table takes it). `packed`, `pack(w)`, spares the kernel packing w again.
    Call it only where `runnable(x, w, bias)`."""
    return _call(x, x.shape[1], w, True, w.shape[0], bias, None, gelu, packed=packed)[0]


def forward_gelu(x: Tensor, w: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(gelu(a), gelu'(a)) for a = x Wᵀ + b rounded to bfloat16, each (M, out): the values of
    fused_gelu.gelu_and_derivative(a), from the same pass as the product."""
    h, d = _call(x, x.shape[1], w, True, w.shape[0], bias, None, True, True)
    return h, d


def input_grad(g: Tensor, w: Tensor, mul: Tensor | None = None) -> Tensor:
    """g (M, out) W with w (out, in): (M, in) bfloat16, times `mul` (M, in) before rounding where given.
    Call it only where `runnable(g, w, forward=False)`."""
    return _call(g, g.shape[1], w, False, w.shape[1], None, mul)[0]

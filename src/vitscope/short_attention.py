"""Inference attention for short bfloat16 sequences on AMX CPUs, in vitscope's own C kernel.

At a ViT's sequence lengths PyTorch's flash kernel spends most of its time on per-block overhead:
for the Fashion-MNIST shape (1,024 heads of 50 tokens, head dim 32) it reaches about 100 GFLOP/s.
`native/short_attention.c` does a whole head's scores in AMX tiles and its softmax in AVX-512 and
writes the output straight into the (B, N, H, D) layout the projection reads.

`attend` runs it where it gives what F.scaled_dot_product_attention would: CPU tensors in bfloat16,
no mask, no dropout, nothing for autograd to record, N_k <= 256 and head dims that are multiples of
32 up to 128, last dims contiguous, outside torch.compile, tracing and torch.func. Everything else,
and every machine where the kernel cannot be built or run (`vitscope.native.why_not()`), keeps
PyTorch's kernel. Tests hold its output to float64 as close as PyTorch's own bfloat16 kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .fused_linear import _transformed

MAX_KEYS = 256
MAX_HEAD_DIM = 128


def usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `attend(q, k, v)` may run the kernel: q (B, H, Nq, D), k and v (B, H, Nk, D)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.layout == torch.strided
               and t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v)):
        return False
    b, h, nq, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, h) or k.shape[-1] != d or min(b, h, nq) < 1:
        return False
    if not (1 <= k.shape[-2] <= MAX_KEYS and d % 32 == 0 and d <= MAX_HEAD_DIM):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or any(_transformed(t) for t in (q, k, v)):
        return False
    return native.library() is not None


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """softmax(scale q kᵀ) v -> (B, H, Nq, D), a view of a (B, Nq, H, D) tensor. Check `usable` first."""
    lib = native.library()
    if lib is None:
        raise RuntimeError(f"vitscope's attention kernel is not available here: {native.why_not()}")
    b, h, nq, d = q.shape
    out = torch.empty(b, nq, h, d, dtype=q.dtype)
    o = out.transpose(1, 2)  # (B, H, Nq, D)
    strides = torch.tensor([*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3]], dtype=torch.int64)
    scale = d**-0.5 if scale is None else float(scale)
    status = lib.vs_attention_fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), b, h, nq, k.shape[-2],
                                  d, strides.data_ptr(), scale, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"vitscope's attention kernel does not take q {tuple(q.shape)}, k {tuple(k.shape)}")
    return o

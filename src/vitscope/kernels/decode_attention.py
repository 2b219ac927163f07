"""A decoding step's cross-attention in vitscope's C kernel (native/decode_attention.c): bfloat16, weights out.

Each step of greedy decoding or beam search asks the image's memory once per block: one query per beam
against the N image tokens' cached keys and values, (B, H, G, D) against (B, H, N, D), and keeps the weights
(what each word looked at). PyTorch runs that as two batched one-row products, which its bfloat16 kernels
take at a few GFLOP/s: at caption_quick's shape they were a third of a step. The kernel packs the keys and
values once per decoding (`pack`, when the cross-attention cache is filled) so that AVX512-BF16's pair dot
products take 16 keys or 16 head dims per instruction, and does scores, softmax, weights and output for a
whole head in one pass.

The numbers are `vitscope.attention.attend`'s up to where each rounds: the kernel keeps the scores in
float32 (`attend` rounds q kᵀ, and its product by the scale, to bfloat16 before the float32 softmax), so
its weights are the closer to the float64 ones; both round the weights to bfloat16 before the product with
the values and sum it in float32. Measurements: docs/performance.md, "Decoding one token at a time".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native, registry

MAX_HEAD_DIM = 128  # the kernel keeps a query's output sums in 8 vectors of 16


def usable(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> bool:
    """Whether `attend` may take q (B, H, G, D) against k and v (B, H, N, D): bfloat16 CPU tensors, q's head
    dims contiguous, D a multiple of 16 up to MAX_HEAD_DIM, `keep` None or a (B, 1, 1, N) boolean key mask,
    outside autograd, and the kernel runnable here."""
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.is_cpu and k.is_cpu and v.is_cpu):
        return False
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return False
    b, _, _, d = q.shape
    if d % 16 or d > MAX_HEAD_DIM or q.stride(3) != 1 or k.shape[2] == 0 or q.requires_grad and torch.is_grad_enabled():
        return False
    if keep is not None and (keep.dtype != torch.bool or keep.shape != (b, 1, 1, k.shape[2])):
        return False
    return registry.runnable("decode attention", torch.bfloat16, q, k, v)


def pack(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's layouts of k and v (B, H, N, D): keys as (B·H, D/2, Np, 2), values as (B·H, Np/2, D, 2),
    Np = N rounded up to 16, zeros past N (native/decode_attention.c)."""
    b, h, n, d = k.shape
    pad = -n % 16
    k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))  # (B, H, Np, D)
    np_ = n + pad
    keys = k.reshape(b * h, np_, d // 2, 2).transpose(1, 2).contiguous()  # (B·H, D/2, Np, 2)
    values = v.reshape(b * h, np_ // 2, 2, d).transpose(2, 3).contiguous()  # (B·H, Np/2, D, 2)
    return keys, values


def attend(q: Tensor, packed: tuple[Tensor, Tensor], n: int, scale: float, keep: Tensor | None = None,
           weights: bool = True) -> tuple[Tensor, Tensor | None]:
    """softmax(q kᵀ · scale) v for q (B, H, G, D) against the `pack`ed keys and values of N = `n` tokens ->
    (the output in the (B, G, H·D) layout the projection reads, the weights (B, H, G, N) in float32 where
    `weights`, else None). `keep` (B, 1, 1, N) is True where a query may look. Call it where `usable`."""
    b, h, g, d = q.shape
    keys, values = packed
    out = torch.empty(b, g, h * d, dtype=torch.bfloat16)
    w = torch.empty(b, h, g, n) if weights else None
    threads = torch.get_num_threads()
    np_ = keys.shape[2]
    work = torch.empty(threads, 2 * np_)
    keep = None if keep is None else keep.reshape(b, n).contiguous()
    native.library().vs_decode_attention_bf16(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), keys.data_ptr(), values.data_ptr(),
        None if keep is None else keep.data_ptr(), b, h, g, n, d, scale, None if w is None else w.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1), work.data_ptr(), threads)
    return out, w

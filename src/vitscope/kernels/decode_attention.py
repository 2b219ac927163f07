"""A decoding step's attention in vitscope's C kernels, weights out: the cross-attention in bfloat16
(native/decode_attention.c), the self- and cross-attention in float32 (native/decode_attention_f32_avx2.c).

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
the values and sum it in float32.

In float32 PyTorch's ops are a dozen per attention (the two one-row products, each a batch of tiny matrix
products, the scale, mask, softmax and re-layouts), which at caption_quick's shape read the cached keys and
values at 7-8 GB/s. `attend_f32` takes the keys and values in place at the cache's strides, nothing packed, so
it serves the self-attention's cache too, which grows by a token every step; its numbers are `attend`'s to
float32 rounding (its exp is a polynomial within 2.4 ulps, its sums in another order). Measurements:
docs/performance.md, "Decoding one token at a time".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native, registry

MAX_HEAD_DIM = 128  # the kernels keep a query's output sums in 8 vectors of 16 (bfloat16) or 16 of 8 (float32)


def usable(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> bool:
    """Whether `attend` (bfloat16) or `attend_f32` (float32) may take q (B, H, G, D) against k and v (B, H, N, D):
    CPU tensors of that dtype, head dims contiguous (in float32 k's and v's too), D a multiple of 16 (bfloat16) or
    8 (float32) up to MAX_HEAD_DIM, `keep` None or a (B, 1, 1, N) boolean key mask, outside autograd, and the
    dtype's kernel runnable here."""
    dtype = q.dtype
    if not (dtype == k.dtype == v.dtype and dtype in (torch.bfloat16, torch.float32) and q.is_cpu and k.is_cpu
            and v.is_cpu):
        return False
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return False
    b, _, _, d = q.shape
    if d % (16 if dtype == torch.bfloat16 else 8) or d > MAX_HEAD_DIM or q.stride(3) != 1 or k.shape[2] == 0:
        return False
    if dtype == torch.float32 and (k.stride(3) != 1 or v.stride(3) != 1):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if keep is not None and (keep.dtype != torch.bool or keep.shape != (b, 1, 1, k.shape[2])):
        return False
    return registry.runnable("decode attention", dtype, q, k, v)


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


def attend_f32(q: Tensor, k: Tensor, v: Tensor, scale: float, keep: Tensor | None = None,
               weights: bool = True) -> tuple[Tensor, Tensor | None]:
    """softmax(q kᵀ · scale) v for float32 q (B, H, G, D) against k and v (B, H, N, D), read in place ->
    (the output in the (B, G, H·D) layout the projection reads, the weights (B, H, G, N) where `weights`, else
    None). `keep` (B, 1, 1, N) is True where a query may look. Call it where `usable`."""
    b, h, g, d = q.shape
    n = k.shape[2]
    out = torch.empty(b, g, h * d)
    w = torch.empty(b, h, g, n) if weights else None
    threads = torch.get_num_threads()
    work = torch.empty(threads, -(-n // 8) * 8)
    keep = None if keep is None else keep.reshape(b, n).contiguous()
    native.library().vs_decode_attention_f32_avx2(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), None if keep is None else keep.data_ptr(), b, h, g, n, d,
        scale, None if w is None else w.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1), work.data_ptr(),
        threads)
    return out, w

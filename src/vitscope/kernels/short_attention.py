"""Attention on CPU in vitscope's own C kernels, forward and backward: any length in bfloat16, and in
float32 short sequences with AVX-512, any length with AVX2 alone.

At a ViT's sequence lengths PyTorch's kernels spend most of their time on per-block overhead, and
training in bfloat16 runs the explicit softmax path, which is no faster; around them the callers pay
re-layout copies (docs/performance.md, "Attention"). vitscope's kernels do a whole head at a time and
write the output straight into the (B, N, H, D) layout the projection reads:

- float32 (`native/attention_f32.c`), on any CPU with AVX-512: every product one register-tiled
  loop of broadcast-multiply-adds, the softmax in AVX-512; on CPUs with AVX2 and FMA alone
  (`native/attention_f32_avx2.c`) the same in 8-float vectors, and past 256 keys blockwise as below;
- bfloat16 (`native/attention_bf16.h`), the scores and products in AMX tiles on CPUs with AMX
  (`native/short_attention.c`), else in AVX512-BF16's pair dot products (`native/attention_bf16.c`:
  AMD Zen 4 and later), on operands packed alike.

The forward keeps each query's log-sum-exp for training; the backward recomputes the weights from
it, flash-style, and returns the three gradients.

`attend` runs them where they give what F.scaled_dot_product_attention would: CPU tensors in
float32 or bfloat16, no mask, no dropout; in float32 with AVX-512 N_k <= 256 (and N_q <= 256 where
gradients are needed), in bfloat16 and in float32 with AVX2 any lengths (past 256, flash attention's
online softmax over blocks of 256 keys forward, and its blockwise backward with float32 sums; with AVX2,
inference past 768 keys stays PyTorch's); head dims that are multiples of 16 (float32 with AVX-512), 8
(float32 with AVX2) or 32 (bfloat16) up to 128, last dims contiguous, outside tracing, forward-mode AD and
torch.func.
Under torch.compile the models' path (`attend_qkv`, from the fused qkv projection) runs as the custom
op `vitscope::qkv_attention`, which the compiled graph keeps; `attend` on separate q, k and v leaves
compiled graphs to PyTorch's kernels. Everything else, and every machine where the kernels cannot be
built or run (`registry.why_none("attention", dtype)` says why), keeps PyTorch's kernels. The backward is
not itself differentiable (double backward raises). Tests hold outputs and gradients to float64 as close
as PyTorch's own paths in the same dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import native, registry

MAX_KEYS = 256
MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class AttentionBuild:
    """What the code needs to know about one instruction set's build of the kernels: the head-dim multiple
    it takes, its forward and backward functions in the native library, and whether they take any number
    of queries and keys (past MAX_KEYS, flash attention's online softmax over key blocks forward and its
    blockwise backward) or at most MAX_KEYS keys (and MAX_KEYS queries where gradients are needed), and
    past how many keys an inference forward is left to PyTorch's kernel, where that was measured faster.
    Which build runs for a dtype is the registry's decision (registry.py, "attention")."""

    head_dim_multiple: int
    forward: str
    backward: str
    any_length: bool = False
    inference_max_keys: int | None = None  # past this many keys, forwards without gradients go to PyTorch


# From 768 keys on, PyTorch's float32 flash kernel takes 256 queries by 512 keys a block in MKL's products,
# and its forward is level with the AVX2 kernel's (docs/performance.md, "Attention"): inference forwards past
# this many keys stay PyTorch's, since at parity nothing is gained by leaving it.
AVX2_FLOAT32_INFERENCE_MAX_KEYS = 768

# Each instruction set's build (the dtype it takes is the registry entry's).
BUILDS = {"avx512": AttentionBuild(16, "vs_attention_f32_fwd", "vs_attention_f32_bwd"),
          "avx2": AttentionBuild(8, "vs_attention_f32_avx2_fwd", "vs_attention_f32_avx2_bwd", any_length=True,
                                 inference_max_keys=AVX2_FLOAT32_INFERENCE_MAX_KEYS),
          "amx": AttentionBuild(32, "vs_attention_fwd", "vs_attention_bwd", any_length=True),
          "avx512_bf16": AttentionBuild(32, "vs_attention_bf16_fwd", "vs_attention_bf16_bwd", any_length=True)}


def build_for(dtype: torch.dtype) -> tuple[str, AttentionBuild] | None:
    """(instruction set, build) of the kernels that run `dtype` here, as the registry decided, or None where
    none can (`registry.why_none("attention", dtype)` says why)."""
    isa = registry.isa("attention", dtype)
    return None if isa is None else (isa, BUILDS[isa])


def _wants_grad(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _fits(q: Tensor, k: Tensor, v: Tensor) -> tuple[str, AttentionBuild] | None:
    """(instruction set, build) that takes q (B, H, Nq, D), k and v (B, H, Nk, D) here, or None."""
    chosen = build_for(q.dtype)
    if chosen is None:
        return None
    kernel = chosen[1]
    if not all(t.device.type == "cpu" and t.dtype == q.dtype and t.layout == torch.strided
                                 and t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v)):
        return None
    b, h, nq, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, h) or k.shape[-1] != d or min(b, h, nq) < 1:
        return None
    nk = k.shape[-2]
    if not (1 <= nk and d % kernel.head_dim_multiple == 0 and d <= MAX_HEAD_DIM):
        return None
    if not kernel.any_length and (nk > MAX_KEYS or (nq > MAX_KEYS and _wants_grad(q, k, v))):
        return None
    if kernel.inference_max_keys is not None and nk > kernel.inference_max_keys and not _wants_grad(q, k, v):
        return None
    return chosen


def usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether `attend(q, k, v)` may run the kernels: q (B, H, Nq, D), k and v (B, H, Nk, D)."""
    chosen = _fits(q, k, v)
    return chosen is not None and native.runnable(q, k, v, isa=chosen[0])


def _kernel(dtype: torch.dtype, backward: bool):
    chosen = build_for(dtype)
    if chosen is None:
        raise RuntimeError(f"vitscope's {dtype} attention kernels are not available here: "
                           f"{registry.why_none('attention', dtype)}")
    return getattr(native.library(), chosen[1].backward if backward else chosen[1].forward)


def _strides(*ts: Tensor) -> Tensor:
    return torch.tensor([s for t in ts for s in t.stride()[:3]], dtype=torch.int64)


def _forward(q: Tensor, k: Tensor, v: Tensor, scale: float, lse: Tensor | None, o: Tensor | None = None) -> Tensor:
    """o = softmax(scale q kᵀ) v (B, H, Nq, D), written into `o` when given, else a view of a new
    (B, Nq, H, D) tensor; lse, when given, gets each query's log-sum-exp (log2 domain)."""
    b, h, nq, d = q.shape
    if o is None:
        o = torch.empty(b, nq, h, d, dtype=q.dtype).transpose(1, 2)  # (B, H, Nq, D), in the (B, Nq, H, D) layout
    strides = _strides(q, k, v, o)
    status = _kernel(q.dtype, False)(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                                     None if lse is None else lse.data_ptr(), b, h, nq, k.shape[-2], d,
                                     strides.data_ptr(), scale, torch.get_num_threads())
    _check(status, q, k)
    return o


def _check(status: int, q: Tensor, k: Tensor) -> None:
    if status == -2:
        raise MemoryError("vitscope's attention kernel could not allocate its scratch memory")
    if status != 0:
        raise ValueError(f"vitscope's attention kernels do not take q {tuple(q.shape)}, k {tuple(k.shape)}")


def _blockwise(q: Tensor, k: Tensor) -> bool:
    """Whether the backward runs blockwise (past MAX_KEYS queries or keys), where it takes each query's
    rowsum(g o) from the output instead of a pass of its own."""
    return q.shape[-2] > MAX_KEYS or k.shape[-2] > MAX_KEYS


def _backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, lse: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
              scale: float, o: Tensor | None = None) -> None:
    """Writes the gradients into dq, dk, dv (B, H, N, D) from g, the output's gradient (B, H, Nq, D);
    o, the output (B, H, Nq, D), where the backward runs blockwise."""
    if g.dtype != q.dtype:
        g = g.to(q.dtype)
    if g.stride(-1) != 1:
        g = g.contiguous()
    delta = None if o is None else (g.float() * o.float()).sum(-1)  # (B, H, Nq), contiguous
    b, h, nq, d = q.shape
    strides = _strides(q, k, v, g, dq, dk, dv)
    status = _kernel(q.dtype, True)(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), lse.data_ptr(),
                                     None if delta is None else delta.data_ptr(), dq.data_ptr(), dk.data_ptr(),
                                     dv.data_ptr(), b, h, nq, k.shape[-2], d, strides.data_ptr(), scale,
                                     torch.get_num_threads())
    _check(status, q, k)


class _Attention(torch.autograd.Function):
    """The kernel's forward, keeping the log-sum-exp; the kernel's backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        lse = torch.empty(q.shape[:3], dtype=torch.float32)  # (B, H, Nq), log2 domain
        o = _forward(q, k, v, scale, lse)
        ctx.save_for_backward(q, k, v, lse, *((o,) if _blockwise(q, k) else ()))
        ctx.scale = scale
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k, v, lse, *o = ctx.saved_tensors
        b, h, nq, d = q.shape
        nk = k.shape[-2]
        dq = torch.empty(b, nq, h, d, dtype=q.dtype).transpose(1, 2)
        dk, dv = torch.empty(2, b, nk, h, d, dtype=q.dtype).permute(0, 1, 3, 2, 4).unbind(0)
        _backward(q, k, v, g, lse, dq, dk, dv, ctx.scale, *o)
        return dq, dk, dv, None


def _split(qkv: Tensor, heads: int, queries: int | None) -> tuple[Tensor, Tensor, Tensor]:
    b, n, three_inner = qkv.shape
    q, k, v = qkv.view(b, n, 3, heads, three_inner // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)
    return (q if queries is None else q[:, :, :queries]), k, v  # (B, H, N, D) views


# Self-attention straight from the fused projection's output and back: the gradient is written into
# one (B, N, 3·H·D) tensor, so no split, stack or re-layout copies run either way. `queries` < 0:
# every token's query. Eager calls run an autograd function; under torch.compile the same code runs as
# a torch.library custom op, which the compiled graph keeps whole (Inductor calls it as an opaque
# kernel) instead of tracing PyTorch's attention in its place. Eager calls keep the autograd function,
# since the custom op's dispatch costs more per call, which small batches feel.


def _qkv_forward(qkv: Tensor, heads: int, scale: float, queries: int, keep_lse: bool) -> tuple[Tensor, Tensor]:
    """(out (B, Nq, H·D), lse (B, H, Nq) float32 where `keep_lse`, else empty)."""
    q, k, v = _split(qkv, heads, queries if queries >= 0 else None)
    b, h, nq, d = q.shape
    out = torch.empty(b, nq, h * d, dtype=qkv.dtype)  # written through (B, H, Nq, D) strides
    lse = torch.empty((b, h, nq) if keep_lse else (0,), dtype=torch.float32)  # log2 domain
    _forward(q, k, v, scale, lse if keep_lse else None, out.view(b, nq, h, d).transpose(1, 2))
    return out, lse


def _qkv_backward(g: Tensor, qkv: Tensor, lse: Tensor, out: Tensor, heads: int, scale: float, queries: int) -> Tensor:
    """qkv's gradient from the output's gradient g (B, Nq, H·D); `out` the forward's output where the
    backward runs blockwise, else an empty tensor."""
    if g.dtype != qkv.dtype:
        g = g.to(qkv.dtype)
    q, k, v = _split(qkv, heads, queries if queries >= 0 else None)
    grad = torch.empty_like(qkv)
    if 0 <= queries < qkv.shape[1]:
        grad[:, queries:, : qkv.shape[-1] // 3].zero_()  # queries past Nq get no gradient
    dq, dk, dv = _split(grad, heads, queries if queries >= 0 else None)
    g = g.reshape(*g.shape[:2], heads, -1).transpose(1, 2)  # (B, H, Nq, D)
    o = [out.view(*out.shape[:2], heads, -1).transpose(1, 2)] if out.numel() else []
    _backward(q, k, v, g, lse, dq, dk, dv, scale, *o)
    return grad


def _save(ctx, qkv: Tensor, heads: int, scale: float, queries: int, out: Tensor, lse: Tensor) -> None:
    """Keeps what the backward needs: qkv, lse, and the output where the backward runs blockwise (else
    an empty tensor), for the autograd function and the custom op alike."""
    q, k, _ = _split(qkv, heads, queries if queries >= 0 else None)
    ctx.save_for_backward(qkv, lse, out if _blockwise(q, k) else out.new_empty(0))
    ctx.heads, ctx.scale, ctx.queries = heads, scale, queries


class _QKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, heads: int, scale: float, queries: int) -> Tensor:
        out, lse = _qkv_forward(qkv, heads, scale, queries, True)
        _save(ctx, qkv, heads, scale, queries, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        qkv, lse, out = ctx.saved_tensors
        return _qkv_backward(g, qkv, lse, out, ctx.heads, ctx.scale, ctx.queries), None, None, None


@torch.library.custom_op("vitscope::qkv_attention", mutates_args=(), device_types="cpu")
def _qkv_attention_op(qkv: Tensor, heads: int, scale: float, queries: int, keep_lse: bool) -> tuple[Tensor, Tensor]:
    return _qkv_forward(qkv, heads, scale, queries, keep_lse)


@_qkv_attention_op.register_fake
def _(qkv: Tensor, heads: int, scale: float, queries: int, keep_lse: bool) -> tuple[Tensor, Tensor]:
    b, n, c3 = qkv.shape
    nq = n if queries < 0 else queries
    return qkv.new_empty(b, nq, c3 // 3), qkv.new_empty((b, heads, nq) if keep_lse else (0,), dtype=torch.float32)


@torch.library.custom_op("vitscope::qkv_attention_backward", mutates_args=(), device_types="cpu")
def _qkv_attention_backward_op(g: Tensor, qkv: Tensor, lse: Tensor, out: Tensor, heads: int, scale: float,
                               queries: int) -> Tensor:
    return _qkv_backward(g, qkv, lse, out, heads, scale, queries)


@_qkv_attention_backward_op.register_fake
def _(g: Tensor, qkv: Tensor, lse: Tensor, out: Tensor, heads: int, scale: float, queries: int) -> Tensor:
    return torch.empty_like(qkv)


def _op_setup_context(ctx, inputs, output) -> None:
    qkv, heads, scale, queries, _ = inputs
    _save(ctx, qkv, heads, scale, queries, *output)


def _op_backward(ctx, g: Tensor, _lse_grad: Tensor):
    qkv, lse, out = ctx.saved_tensors
    return _qkv_attention_backward_op(g, qkv, lse, out, ctx.heads, ctx.scale, ctx.queries), None, None, None, None


_qkv_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def usable_qkv(qkv: Tensor, heads: int, queries: int | None = None) -> bool:
    """Whether `attend_qkv(qkv, heads, ...)` may run the kernels: qkv (B, N, 3·H·D), contiguous."""
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * heads) or not qkv.is_contiguous():
        return False
    q, k, v = _split(qkv, heads, queries)
    if torch.compiler.is_compiling():  # a custom op, which the compiled graph keeps (native.has answers there)
        return qkv.device.type == "cpu" and _fits(q, k, v) is not None
    return usable(q, k, v)


def attend_qkv(qkv: Tensor, heads: int, scale: float, queries: int | None = None) -> Tensor:
    """Self-attention of a fused projection's output qkv (B, N, 3·H·D) -> (B, Nq, H·D), the heads
    side by side; `queries=n` takes the first n tokens' queries. Check `usable_qkv` first."""
    training = torch.is_grad_enabled() and qkv.requires_grad
    queries = -1 if queries is None else queries
    if torch.compiler.is_compiling():
        return _qkv_attention_op(qkv, heads, float(scale), queries, training)[0]
    if training:
        return _QKVAttention.apply(qkv, heads, float(scale), queries)
    return _qkv_forward(qkv, heads, float(scale), queries, False)[0]


# Cross-attention straight from its two projections and back, as attend_qkv does for self-attention: the queries
# from `q`'s output (B, Nq, H·D), the keys and values from the fused `kv`'s (B, M, 2·H·D). The gradients are written
# into tensors of those two layouts, so no select's zero-filled gradient, stack or re-layout copy runs backward
# (a captioner's training step spent 23 of 430 ms on them on a Zen 3; docs/performance.md).


def split_q_kv(q: Tensor, kv: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views q (B, H, Nq, D), k and v (B, H, M, D) of the projections' outputs q (B, Nq, H·D) and kv (B, M, 2·H·D)."""
    b, nq, inner = q.shape
    qh = q.view(b, nq, heads, inner // heads).transpose(1, 2)
    k, v = kv.view(b, kv.shape[1], 2, heads, inner // heads).permute(2, 0, 3, 1, 4).unbind(0)
    return qh, k, v


def _q_kv_forward(q: Tensor, kv: Tensor, heads: int, scale: float, lse: Tensor | None) -> Tensor:
    """The output (B, Nq, H·D), written through (B, H, Nq, D) strides; lse, when given, each query's log-sum-exp."""
    out = torch.empty_like(q)
    _forward(*split_q_kv(q, kv, heads), scale, lse, out.view(*q.shape[:2], heads, -1).transpose(1, 2))
    return out


class _CrossAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, heads: int, scale: float) -> Tensor:
        qh, k, _ = split_q_kv(q, kv, heads)
        lse = torch.empty(qh.shape[:3], dtype=torch.float32)  # (B, H, Nq), log2 domain
        out = _q_kv_forward(q, kv, heads, scale, lse)
        ctx.save_for_backward(q, kv, lse, *((out,) if _blockwise(qh, k) else ()))
        ctx.heads, ctx.scale = heads, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, kv, lse, *out = ctx.saved_tensors
        heads = ctx.heads
        dq, dkv = torch.empty_like(q), torch.empty_like(kv)
        g = g.to(q.dtype).reshape(*g.shape[:2], heads, -1).transpose(1, 2)  # (B, H, Nq, D)
        o = [out[0].view(*q.shape[:2], heads, -1).transpose(1, 2)] if out else []
        _backward(*split_q_kv(q, kv, heads), g, lse, *split_q_kv(dq, dkv, heads), ctx.scale, *o)
        return dq, dkv, None, None


def usable_q_kv(q: Tensor, kv: Tensor, heads: int) -> bool:
    """Whether `attend_q_kv(q, kv, heads, ...)` may run the kernels: q (B, Nq, H·D) and kv (B, M, 2·H·D), both
    contiguous, outside torch.compile (compiled graphs keep PyTorch's attention here, as for `attend`)."""
    if (q.dim() != 3 or kv.dim() != 3 or q.shape[0] != kv.shape[0] or q.shape[-1] % heads
            or kv.shape[-1] != 2 * q.shape[-1] or not (q.is_contiguous() and kv.is_contiguous())
            or torch.compiler.is_compiling()):
        return False
    return usable(*split_q_kv(q, kv, heads))


def attend_q_kv(q: Tensor, kv: Tensor, heads: int, scale: float) -> Tensor:
    """Cross-attention of the query projection's output q (B, Nq, H·D) over the fused key-value projection's kv
    (B, M, 2·H·D) -> (B, Nq, H·D), the heads side by side; differentiable. Check `usable_q_kv` first."""
    if torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad):
        return _CrossAttention.apply(q, kv, heads, float(scale))
    return _q_kv_forward(q, kv, heads, float(scale), None)


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """softmax(scale q kᵀ) v -> (B, H, Nq, D), a view of a (B, Nq, H, D) tensor, differentiable where
    q, k or v need gradients. Check `usable` first."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if _wants_grad(q, k, v):
        return _Attention.apply(q, k, v, scale)
    return _forward(q, k, v, scale, None)

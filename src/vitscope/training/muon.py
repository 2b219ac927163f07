"""Muon with one Newton-Schulz iteration for all matrices of a shape: `torch.optim.Muon`'s numbers, fewer calls.

`torch.optim.Muon` orthogonalises each matrix alone: five iterations of three small bfloat16 matmuls,
fifteen calls per matrix. A ViT's blocks repeat their shapes (every block's qkv, proj, fc1 and fc2;
fc1ᵀ has fc2's shape), so here the matrices that share a shape once oriented wide (rows ≤ columns, as
torch orients them) are stacked and iterated together with `bmm`/`baddbmm`, and the momentum, weight
decay and update run as `_foreach` ops. Every operation is the one torch applies to each matrix, in the
same dtype and order; the parameters come out bit for bit as `torch.optim.Muon`'s on the CPUs we
measured (tests/test_muon.py checks them to bfloat16 rounding, docs/performance.md gives their timings).

It is a `torch.optim.Muon`: the same arguments, param groups and state (`momentum_buffer` per
parameter), so its state dicts load into either. With a torch that has no `torch.optim.Muon`,
building one raises an error that says so.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from vitscope.kernels import bf16

_TORCH_MUON = getattr(torch.optim, "Muon", None)


def _adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate for a matrix of `shape`, as torch.optim.Muon scales it: Keller Jordan's
    sqrt(max(1, A / B)) ("original", the default), or Moonshot's 0.2 sqrt(max(A, B)) ("match_rms_adamw",
    an update the size of AdamW's)."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(a, b)))
    return lr


def _orient(u: Tensor) -> Tensor:
    """u as bfloat16, transposed when it has more rows than columns (torch's orientation)."""
    x = u.bfloat16()
    return x.T if u.size(0) > u.size(1) else x


def _rounded(x: Tensor) -> Tensor:
    """A float32 result rounded to bfloat16 and held in float32: what a bfloat16 op with float32
    accumulation returns, for CPUs that only emulate bfloat16 matmuls (vitscope.kernels.bf16)."""
    return x.bfloat16().float()


def orthogonalize(updates: list[Tensor], ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float) -> list[Tensor]:
    """torch.optim.Muon's Newton-Schulz iteration for matrices that share one oriented shape (m, n), m ≤ n:
    each scaled to unit Frobenius norm, then X ← aX + (bA + cA²)X with A = XXᵀ. Returns bfloat16 results in
    each input's own orientation.

    Where the device has no native bfloat16 matmul (an AVX2-only CPU), each operation runs in float32 on
    the bfloat16 values and its result is rounded to bfloat16, as a native kernel accumulates in float32
    and rounds once: the same numbers to float32 summation order, 6-8x faster than PyTorch's fallback."""
    a, b, c = ns_coefficients
    native = bf16.native_matmul(updates[0].device)
    rnd = (lambda t: t) if native else _rounded
    xs = [x if native else x.float() for x in map(_orient, updates)]
    if len(xs) == 1:  # torch's own 2-D calls (one mm is faster than a bmm of one)
        x = xs[0]
        x = rnd(x.div(rnd(x.norm()).clamp(min=eps)))
        for _ in range(ns_steps):
            gram = rnd(x @ x.T)  # (m, m)
            gram = rnd(torch.addmm(gram, gram, gram, beta=b, alpha=c))
            x = rnd(torch.addmm(x, gram, x, beta=a))
        x = x.bfloat16()
        return [x.T if updates[0].size(0) > updates[0].size(1) else x]
    norms = rnd(torch.stack(torch._foreach_norm(xs)))  # each matrix's norm as torch takes it, (k,)
    x = torch.stack(xs)  # (k, m, n)
    x = rnd(x.div_(norms.clamp(min=eps).view(-1, 1, 1)))
    for _ in range(ns_steps):
        gram = rnd(torch.bmm(x, x.mT))  # (k, m, m)
        gram = rnd(torch.baddbmm(gram, gram, gram, beta=b, alpha=c))
        x = rnd(torch.baddbmm(x, gram, x, beta=a))
    x = x.bfloat16()
    return [xi.T if u.size(0) > u.size(1) else xi for xi, u in zip(x.unbind(0), updates)]


class Muon(_TORCH_MUON or torch.optim.Optimizer):
    """`torch.optim.Muon` whose step orthogonalises same-shaped matrices in one batched iteration."""

    def __init__(self, params, *args, **kwargs):
        if _TORCH_MUON is None:
            raise RuntimeError(f"Muon needs torch.optim.Muon, which torch {torch.__version__} does not have: "
                               "upgrade torch, or train with --optimizer adamw")
        super().__init__(params, *args, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            if not params:
                continue
            if any(g.ndim != 2 for g in grads):
                raise ValueError("Muon's gradients must be 2-D matrices, as its parameters")
            lr, momentum = group["lr"], group["momentum"]
            lr = lr.item() if isinstance(lr, Tensor) else lr
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            same_shape: dict[tuple, list[int]] = defaultdict(list)
            for i, u in enumerate(updates):
                same_shape[(min(u.shape), max(u.shape), u.device)].append(i)
            for idx in same_shape.values():
                ortho = orthogonalize([updates[i] for i in idx], group["ns_coefficients"], group["ns_steps"],
                                      group["eps"])
                for i, o in zip(idx, ortho):
                    params[i].add_(o, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], params[i].shape))
        return loss

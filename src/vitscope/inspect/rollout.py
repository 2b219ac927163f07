"""Attention rollout (Abnar & Zuidema, 2020) and gradient-weighted rollout (Chefer et al., 2021).

Both return a token-to-token matrix (B, N, N): row i says how much token i at the output draws on
each input token. `rollout_map` turns it into a (B, h, w) map over the patches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from vitscope.inspect.capture import TokenLayout, capturing, model_device, select_modules
from vitscope.inspect.stats import query_map

HeadFusion = Literal["mean", "max", "min"]


def fuse_heads(weights: Tensor, head_fusion: HeadFusion = "mean") -> Tensor:
    """(B, H, N, N) -> (B, N, N) by the mean, max or min over heads."""
    if head_fusion == "mean":
        return weights.mean(1)
    if head_fusion == "max":
        return weights.amax(1)
    if head_fusion == "min":
        return weights.amin(1)
    raise ValueError(f"head_fusion must be 'mean', 'max' or 'min', got {head_fusion!r}")


def discard_lowest(a: Tensor, ratio: float, num_prefix_tokens: int = 0) -> Tensor:
    """Zero the lowest `ratio` of each row's patch entries; prefix-token columns are always kept."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {ratio}")
    p = num_prefix_tokens
    k = int(ratio * (a.shape[-1] - p))
    if k == 0:
        return a
    patches = a[..., p:]
    lowest = patches.topk(k, dim=-1, largest=False).indices
    return torch.cat([a[..., :p], patches.scatter(-1, lowest, 0.0)], dim=-1)


def rollout(layers: Sequence[Tensor] | Tensor, *, head_fusion: HeadFusion = "mean",
            discard_ratio: float = 0.0, num_prefix_tokens: int = 0) -> Tensor:
    """Attention rollout over layers given first to last, each (B, H, N, N): (B, N, N).

    Per layer: fuse heads, discard the lowest entries, add the identity for the residual path,
    re-normalise each row to sum 1; then multiply the layers, last on the left.
    """
    result = None
    for w in layers:
        a = discard_lowest(fuse_heads(w.float(), head_fusion), discard_ratio, num_prefix_tokens)  # (B, N, N)
        a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = a / a.sum(dim=-1, keepdim=True)
        result = a if result is None else a @ result
    if result is None:
        raise ValueError("rollout needs at least one layer of attention weights")
    return result


def rollout_map(matrix: Tensor, layout: TokenLayout) -> Tensor:
    """(B, N, N) rollout -> (B, h, w): the first prefix token's row over the patches, or with no
    prefix token the mean of the patch rows (what average pooling reads)."""
    return query_map(matrix, layout, 0 if layout.num_prefix_tokens else None)


def _targets(logits: Tensor, target: int | Tensor | None) -> Tensor:
    if target is None:
        return logits.argmax(-1)
    if isinstance(target, int):
        return torch.full((logits.shape[0],), target, dtype=torch.long, device=logits.device)
    return target.to(logits.device).long()


def grad_rollout(model: nn.Module, x: Tensor, target: int | Tensor | None = None, *, layers=None) -> Tensor:
    """Gradient-weighted rollout for class `target` (an int, a (B,) tensor, or None: the predicted
    class): (B, N, N).

    Per layer, Ā = mean over heads of clamp(A ⊙ ∂y_c/∂A, min=0); then R ← R + Ā R starting from the
    identity (Chefer et al., "Generic attention-model explainability", 2021).
    """
    chosen = [n for n, _ in select_modules(model, layers)]
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad(), capturing(model, layers=chosen, keep_grad=True) as cap:
            # a model on a GPU takes CPU images
            logits = model(x.detach().to(model_device(model, x.device)).requires_grad_(True))
            cls = _targets(logits, target)
            score = logits.gather(1, cls[:, None]).sum()
            weights = [cap[n] for n in chosen]
            grads = torch.autograd.grad(score, weights)
    finally:
        model.train(was_training)
    b, _, n, _ = weights[0].shape
    r = torch.eye(n).expand(b, n, n).clone()
    for w, g in zip(weights, grads):
        cam = (w.detach() * g).clamp_min(0).mean(1).cpu()  # (B, N, N)
        r = r + cam @ r
    return r

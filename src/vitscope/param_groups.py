"""The optimizer's parameter groups every vitscope model uses: weight decay on weight matrices only."""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups for any vitscope model: decay on matrices only, never on norms, biases, or what the model
    lists in `no_weight_decay()` (tokens, position tables, word embeddings)."""
    skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

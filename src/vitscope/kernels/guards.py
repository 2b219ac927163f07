"""What every fast module asks before it takes its fast path: may a hook see the call, does autograd record it,
is dropout active; and how a fast module decides what its children's types decide (`DecidesOnSwap`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module


def hooked(*modules: nn.Module) -> bool:
    """Whether a hook could see these modules called (their own hooks, or global ones)."""
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for m in modules)


def records(*ts: Tensor) -> bool:
    """Whether autograd records an op on these tensors now."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def dropping(drop: nn.Dropout) -> bool:
    return drop.training and drop.p > 0


class DecidesOnSwap:
    """A fast module decides what its children's types decide when it is swapped in, and again whenever one
    of its children is replaced (`mlp.fc1 = MyLinear(...)`), so a replaced child is never bypassed."""

    def _decide(self) -> None:
        pass

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if isinstance(value, nn.Module) and self.__dict__.get("_decided"):
            self._decide()

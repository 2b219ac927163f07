"""The optimizer a run trains with: AdamW, or Muon for the hidden weight matrices with AdamW beside it.

Muon (`torch.optim.Muon`, run as vitscope.training.muon.Muon: the same numbers with same-shaped matrices
orthogonalised together; Jordan et al., 2024) replaces each hidden matrix's momentum by a nearby
semi-orthogonal matrix (five Newton-Schulz iterations), so every direction of the update moves at
the same rate instead of the few that dominate the gradient. As in Muon's own recipe, the layer
that reads the pixels, the classifier head, norms, biases, tokens and position tables stay with
AdamW. With `adjust_lr_fn="match_rms_adamw"` Muon's update has the size of AdamW's, so both share
one learning rate, one weight decay and one schedule.

A conv kernel (O, I, kh, kw) is a matrix as well, (O, I·kh·kw) in the order its memory holds. torch's
Muon takes 2-D tensors only, so it is given a 2-D view of the kernel's storage: the step writes
through the view into the kernel, and each gradient is copied into the view's `.grad` first.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from vitscope.errors import ConfigError

from .muon import Muon

OptimizerName = Literal["adamw", "muon"]


def matrix_view(p: Tensor) -> tuple[Tensor, bool]:
    """A 2-D view (O, rest) of a weight's storage, and whether it runs in channels-last order.

    Raises if the weight's strides allow no such view (it is then neither contiguous nor channels-last).
    """
    if p.ndim == 2:
        return p, False
    flat = p.detach()
    if p.is_contiguous():
        return flat.view(p.shape[0], -1), False
    if p.ndim == 4 and p.is_contiguous(memory_format=torch.channels_last):
        return flat.permute(0, 2, 3, 1).view(p.shape[0], -1), True  # (O, kh·kw·I)
    raise ValueError(f"a weight of shape {tuple(p.shape)} and strides {p.stride()} has no 2-D view for Muon; "
                     f"make it contiguous or channels-last")


def is_head(name: str) -> bool:
    """An output layer: the classifier's `head.weight`, or a submodule's (the captioner's `decoder.head.weight`,
    which reads out the vocabulary the way a classifier reads out its classes)."""
    return name == "head.weight" or name.endswith(".head.weight")


def muon_param_names(model: nn.Module) -> list[str]:
    """The hidden weight matrices: every weight of 2 or more dimensions except the first layer (it reads
    pixels), the output layers (`is_head`) and what the model lists in `no_weight_decay()` (tokens,
    position tables, word embeddings)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    skip = set(getattr(model, "no_weight_decay", set)())
    first = next((n for n, p in named if n not in skip), None)  # registration order: input side first
    return [n for n, _ in named if n not in skip and n != first and not is_head(n)]


class MuonWithAdamW:
    """Muon on the hidden matrices, AdamW on everything else; one `param_groups` list for the schedule."""

    def __init__(self, model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                 momentum: float = 0.95, fused: bool = False):
        names = set(muon_param_names(model))
        self.views: list[tuple[Tensor, Tensor, bool]] = []  # (weight, its 2-D view, channels-last order)
        skip = set(getattr(model, "no_weight_decay", set)())
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if name in names:
                view, cl = matrix_view(p)
                self.views.append((p, view, cl))
            elif p.ndim <= 1 or name in skip:
                no_decay.append(p)
            else:
                decay.append(p)
        self.muon = Muon([v for _, v, _ in self.views], lr=lr, weight_decay=weight_decay,
                                     momentum=momentum, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                        {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, fused=fused)

    @property
    def param_groups(self) -> list[dict]:
        # read anew each time: load_state_dict gives both optimizers new group dicts
        return self.muon.param_groups + self.adamw.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        for p, view, _ in self.views:
            p.grad = view.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, view, cl in self.views:
            if view is p:
                continue
            g = p.grad
            if g is not None:
                g = g.permute(0, 2, 3, 1) if cl else g
                view.grad = g.reshape(view.shape)  # (O, kh·kw·I) or (O, I·kh·kw), as the view
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ConfigError("this optimizer state was not saved by a Muon run; resume with the run's own "
                             "config (its config.json names the optimizer)")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_optimizer(name: OptimizerName, model: nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float], device: torch.device):
    """The run's optimizer. fused AdamW on CPU and CUDA: torch's default loops over parameters there,
    ~3% of a small model's step on CPU (it uses foreach on CUDA only)."""
    fused = device.type in ("cpu", "cuda")
    if name == "muon":
        return MuonWithAdamW(model, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)
    if name == "adamw":
        return torch.optim.AdamW(model.param_groups(weight_decay), lr=lr, betas=betas, fused=fused)
    raise ConfigError(f"optimizer must be 'adamw' or 'muon', got {name!r}")

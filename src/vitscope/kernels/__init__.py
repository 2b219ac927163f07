"""Everything that makes CPUs fast, apart from the model: vitscope's C kernels (native/: sources, CPU
features, build and loader), the autograd functions that call them (fused_*.py, linear_*.py,
short_attention.py, decode_attention.py), the fast modules that stand in for the model's own (modules.py, and
the decoder's one-token step in fast_decoder.py; which stands in for which: swapping.py; what they check before
taking a fast path: guards.py), and one registry (registry.py).

    model = vitscope.kernels.apply(create_model("vit_fmnist_quick"))   # or create_model(..., kernels=True)
    with vitscope.kernels.disabled():                                  # PyTorch's ops alone, for a baseline
        ...

A model built in Python is plain PyTorch until `apply` swaps the fast classes in. They give the plain
modules' numbers within the dtype's tolerance, and hand any call a user could observe (attention capture,
head masks, returned weights, masks, caches, hooks, active dropout or stochastic depth) to the plain path.
`VITSCOPE_NATIVE=0` keeps the C kernels from loading; `VITSCOPE_ISA=avx2` (or avx512, avx512_bf16) caps
the instruction set, so a larger CPU runs, and tests, the kernels of a smaller one.
"""

from __future__ import annotations

from torch import Tensor, nn

from vitscope.attention import attend as plain_attend
from vitscope.kernels import registry, short_attention
from vitscope.kernels.registry import KERNELS, Kernel, disabled, enabled, why_not
from vitscope.kernels.swapping import swap_in, swap_out


def apply(model: nn.Module) -> nn.Module:
    """Swap vitscope's fast modules into `model` in place and return it. Parameters, state_dict, hooks
    and wrappers are untouched; `revert(model)` undoes it. Safe to call twice. Which kernels run on this CPU
    is decided here, once (registry.decide)."""
    registry.decide()
    return swap_in(model)


def revert(model: nn.Module) -> nn.Module:
    """Give `model` its plain PyTorch modules back, in place, and return it."""
    return swap_out(model)


def attend(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None) -> Tensor:
    """`vitscope.attention.attend(q, k, v, scale=scale)` (no mask, no dropout) through vitscope's attention
    kernels where they run: q (B, H, Nq, D), k and v (B, H, Nk, D) -> (B, H, Nq, D)."""
    if enabled() and short_attention.usable(q, k, v):
        return short_attention.attend(q, k, v, scale)
    return plain_attend(q, k, v, scale=scale)


__all__ = ["KERNELS", "Kernel", "apply", "attend", "disabled", "enabled", "revert", "why_not"]

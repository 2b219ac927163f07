"""Fixtures the tests share; plain helper functions are in helpers.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def vit_bf16_grads(monkeypatch):
    """grads(off=None) -> {name: gradient} for one bfloat16-autocast training step of a two-block plain
    28×28 ViT on a fixed batch; with off=(module, "fusable") that switch answers no for the step, so the
    kernels' gradients can be held to PyTorch's own path's."""
    from vitscope.models import create_model

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=2, kernels=True)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))

    def grads(off: tuple[object, str] | None = None) -> dict[str, torch.Tensor]:
        with monkeypatch.context() as m:
            if off is not None:
                m.setattr(*off, lambda *a: False)
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                F.cross_entropy(model(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    return grads

"""vitscope's float32 GELU kernel (native/gelu_f32_avx2.c, CPUs with AVX2 and no AVX-512) against float64 and
PyTorch's float32 GELU: values, gradients, lengths, layouts, NaN and infinities, and the ViT MLP using it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_close
from vitscope.kernels import fused_gelu, registry
from vitscope.models import create_model

needs_kernel = pytest.mark.skipif(not fused_gelu.fusable(torch.ones(2)),
                                  reason=f"float32 GELU kernel off here: {registry.why_none('gelu', torch.float32)}")


def _cdf64(a):
    return 0.5 * torch.special.erfc(-a / math.sqrt(2))


def _gelu64(a):
    return a * _cdf64(a)


def _dgelu64(a):
    return _cdf64(a) + a * torch.exp(-a * a / 2) / math.sqrt(2 * math.pi)


def _inputs(n: int = 400_000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.cat([torch.linspace(-16, 16, n), torch.randn(n, generator=gen) * 3,
                      torch.tensor([0.0, -0.0, 1e-30, -1e-30, 5.9, -5.9, 12.7, -12.7, 13.0, -13.0])])


@needs_kernel
def test_gelu_matches_float64_as_closely_as_pytorch():
    x = _inputs()
    ours, theirs, exact = fused_gelu.gelu(x), F.gelu(x), _gelu64(x.double())
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    err, err_theirs = ((t.double() - exact).abs() for t in (ours, theirs))
    assert err.max() <= 1.1 * err_theirs.max(), (err.max(), err_theirs.max())
    # where 1 + erf cancels (x < -4) PyTorch keeps no relative accuracy; the kernel's erfc keeps 1e-4 or better
    # (the rounding of x² is multiplied by up to 80 in exp(-x²/2))
    tail = (x < -4) & (exact.abs() > 1e-30)
    assert (err[tail] / exact[tail].abs()).max() < 1e-4 < (err_theirs[tail] / exact[tail].abs()).max()


@needs_kernel
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gradient_matches_float64_as_closely_as_pytorch(layout):
    x = _inputs(20_000)[: 4 * 8 * 23 * 27].reshape(4, 8, 23, 27)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(4, 27, 23, 8, generator=torch.Generator().manual_seed(1)).permute(0, 3, 2, 1)  # other strides
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    fused_gelu.GELU()(a).backward(g)
    F.gelu(b).backward(g)
    exact = g.double() * _dgelu64(x.double())
    err, err_theirs = ((t.double() - exact).abs().max() for t in (a.grad, b.grad))
    assert err <= 1.1 * err_theirs + 1e-7, (err, err_theirs)
    assert a.grad.stride() == x.stride()


@needs_kernel
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4095, 4097, 100_003])
def test_every_element_of_any_length(n):
    x = torch.randn(n) * 4
    torch.testing.assert_close(fused_gelu.gelu(x), F.gelu(x), atol=1e-6, rtol=1e-6)
    a = x.clone().requires_grad_()
    g = torch.randn(n)
    fused_gelu.gelu(a).backward(g)
    torch.testing.assert_close(a.grad, torch.ops.aten.gelu_backward(g, x), atol=2e-6, rtol=1e-5)


@needs_kernel
def test_nan_and_infinities_as_pytorch():
    """NaN stays NaN, and -inf gives NaN (-inf · Φ(-inf) = -inf · 0), as PyTorch's kernels give. At +inf the
    kernel gives +inf, the limit; PyTorch's own answer there depends on the CPU it runs on (its 8-wide AVX2
    kernel gives +inf, its 16-wide AVX-512 one NaN), so the test holds the kernel to the limit, not to the host."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 40.0, -40.0])
    ours = fused_gelu.gelu(x)
    assert torch.isnan(ours[0]) and ours[1] == float("inf") and torch.isnan(ours[2])
    assert torch.isnan(F.gelu(x)[[0, 2]]).all()
    assert F.gelu(x)[1] == float("inf") or torch.isnan(F.gelu(x)[1])
    torch.testing.assert_close(ours[3:], F.gelu(x)[3:])
    a = x.clone().requires_grad_()
    fused_gelu.gelu(a).backward(torch.ones(6))
    ours, theirs = a.grad, torch.ops.aten.gelu_backward(torch.ones(6), x)
    assert torch.isnan(ours[0]) and torch.isnan(theirs[0])
    torch.testing.assert_close(ours[3:], theirs[3:])


@needs_kernel
def test_double_backward_raises():
    a = torch.randn(16, requires_grad=True)
    (g,) = torch.autograd.grad(fused_gelu.GELU()(a).sum(), a, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@needs_kernel
def test_a_vit_trains_through_it_with_pytorchs_gradients(monkeypatch):
    from vitscope.kernels import fused_bn_gelu, fused_mlp

    calls = []
    kernel = fused_gelu.gelu
    monkeypatch.setattr(fused_gelu, "gelu", lambda a: calls.append(a.shape) or kernel(a))
    # the MLPs as modules (where fused_mlp runs, fc1's product takes their GELU: tests/test_linear_f32.py), and
    # the stem's BatchNorm and GELU apart (where fused_bn_gelu runs, one kernel takes both:
    # tests/test_fused_bn_gelu_f32.py)
    monkeypatch.setattr(fused_mlp, "fusable", lambda *a: False)
    monkeypatch.setattr(fused_bn_gelu, "fusable", lambda *a: False)
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick", kernels=True)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def grads():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = grads()
    assert len(calls) == len(model.config.stem) + model.config.depth  # every stem layer and every MLP
    monkeypatch.setattr(fused_gelu, "fusable", lambda a: False)
    assert_grads_close(ours, grads(), 1e-4)

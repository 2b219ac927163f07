"""GELU from vitscope's table (fused_gelu.py): every bfloat16 value against float64, gradients, layouts,
where it stands aside, and the conv stem that uses it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vitscope.kernels import fused_bn_gelu, fused_gelu, native
from vitscope.models import create_model

BF = torch.bfloat16
needs_kernel = pytest.mark.skipif(not fused_gelu.fusable(torch.ones(2, dtype=BF)),
                                  reason=f"vitscope's kernels unavailable: {native.unavailable('avx512_bf16')}")


def _cdf64(a):  # erfc keeps the far negative tail, where 1 + erf cancels to 0
    return 0.5 * torch.special.erfc(-a / math.sqrt(2))


def _gelu64(a):
    return a * _cdf64(a)


def _dgelu64(a):
    return _cdf64(a) + a * torch.exp(-a * a / 2) / math.sqrt(2 * math.pi)


def _rounded(exact):  # float64 -> bfloat16, as the kernel's table rounds (PyTorch goes through float32 too)
    return exact.float().to(BF)


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@needs_kernel
def test_gelu_and_derivative_are_the_float64_values_rounded_for_every_bfloat16_input():
    a = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF)  # all 65536 bit patterns
    h, d = fused_gelu.gelu_and_derivative(a)
    finite = torch.isfinite(a)
    a64 = a[finite].double()
    assert _same_bits(h[finite], _rounded(_gelu64(a64))) and _same_bits(d[finite], _rounded(_dgelu64(a64)))
    assert h[~finite].isnan().all() and d[~finite].isnan().all()  # NaN and ±inf: NaN, as F.gelu and its gradient
    # F.gelu in bfloat16 (a float32 evaluation, rounded) is off by an ulp here and there: never closer.
    assert (h[finite].double() - _gelu64(a64)).abs().le((F.gelu(a[finite]).double() - _gelu64(a64)).abs()).all()
    assert _same_bits(fused_gelu.gelu(a), h) and _same_bits(fused_gelu.gelu_(a.clone()), h)  # value-only passes


@needs_kernel
@pytest.mark.parametrize("n", [1, 3, 15, 16, 4097, 100_003])
def test_gelu_and_derivative_cover_every_element_of_any_length(n):
    gen = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=gen) * 4).to(BF)
    a[: min(n, 6)] = torch.tensor([0.0, -0.0, 50.0, -50.0, 9.5, -9.5])[: min(n, 6)].to(BF)  # tails and zeros
    h, d = fused_gelu.gelu_and_derivative(a)
    assert _same_bits(h, _rounded(_gelu64(a.double()))) and _same_bits(d, _rounded(_dgelu64(a.double())))


@needs_kernel
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_module_output_and_gradient_match_float64_as_closely_as_pytorchs(layout):
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(4, 8, 6, 5, generator=gen) * 2).to(BF)
    g = torch.randn(4, 8, 6, 5, generator=gen).to(BF)
    if layout == "channels_last":
        a, g = a.contiguous(memory_format=torch.channels_last), g.contiguous(memory_format=torch.channels_last)
    ours_in, theirs_in = a.clone().requires_grad_(), a.clone().requires_grad_()
    ours = fused_gelu.GELU()(ours_in)
    ours.backward(g)
    theirs = F.gelu(theirs_in)
    theirs.backward(g)
    assert ours.grad_fn is not None and type(ours.grad_fn).__name__.startswith("_Gelu")
    assert ours.dtype == BF and ours.stride() == a.stride()  # laid out as its input
    assert _same_bits(ours, _rounded(_gelu64(a.double())))
    exact_grad = g.double() * _dgelu64(a.double())
    err = (ours_in.grad.double() - exact_grad).abs().max().item()
    err_torch = (theirs_in.grad.double() - exact_grad).abs().max().item()
    assert err <= max(2 * err_torch, 1e-2 * exact_grad.abs().max().item()), (err, err_torch)


@needs_kernel
def test_double_backward_raises():
    a = torch.randn(16, dtype=BF, requires_grad=True)
    (g,) = torch.autograd.grad(fused_gelu.GELU()(a).sum(), a, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize("case", ["float64", "tanh", "strided"])
def test_module_is_nn_gelu_where_the_table_does_not_apply(case):
    x = torch.randn(6, 10)
    if case == "float64":
        module, x = fused_gelu.GELU(), x.double()
    elif case == "tanh":
        module, x = fused_gelu.GELU(approximate="tanh"), x.to(BF)
    else:
        module, x = fused_gelu.GELU(), x.to(BF)[:, ::2]  # neither contiguous nor channels-last
    assert not (module.approximate == "none" and fused_gelu.fusable(x))
    assert torch.equal(module(x), F.gelu(x, approximate=module.approximate))


@needs_kernel
def test_the_conv_stem_takes_its_gelus_from_the_table_in_bfloat16_training(monkeypatch):
    """Where its BatchNorm and GELU cannot run as one kernel (fused_bn_gelu.py), the GELU module alone."""
    monkeypatch.setattr(fused_bn_gelu, "fusable", lambda *a: False)
    calls = []
    table = fused_gelu.gelu
    monkeypatch.setattr(fused_gelu, "gelu", lambda a: calls.append(a.shape) or table(a))
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick", kernels=True)
    x = torch.randn(4, 1, 28, 28)
    with torch.autocast("cpu", dtype=BF):
        model(x).float().sum().backward()
    assert len(calls) == len(model.config.stem)  # one per stem layer; the blocks' MLPs have their own path
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "stem" in n}
    monkeypatch.setattr(fused_gelu, "fusable", lambda a: False)  # nn.GELU's own ops
    model.zero_grad()
    with torch.autocast("cpu", dtype=BF):
        model(x).float().sum().backward()
    for name, grad in grads.items():
        ref = dict(model.named_parameters())[name].grad
        assert (grad - ref).abs().max() <= 0.05 * ref.abs().max(), name  # bfloat16 rounding apart

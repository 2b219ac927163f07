"""The bfloat16 training MLP (C GELU and its derivative, fused multiply in the backward) against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_close
from vitscope import kernels
from vitscope.kernels import fused_mlp, native
from vitscope.vit import Mlp

_w = torch.ones(2, 2, dtype=torch.bfloat16)
needs_kernel = pytest.mark.skipif(not fused_mlp.fusable(_w.clone().requires_grad_(), _w, None, _w, None),
                                  reason=f"fused MLP unavailable: {native.unavailable() or 'no oneDNN bf16 linear'}")
BF = torch.bfloat16


def _mlp_grads(fn, x, w1, b1, w2, b2, g):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w1, b1, w2, b2)]
    out = fn(*leaves)
    out.backward(g)
    return [out.detach()] + [t.grad if t is not None else None for t in leaves]


def _modules(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_float64_as_closely_as_the_modules(bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 50, 64, generator=gen).to(BF)
    w1, w2 = (torch.randn(256, 64, generator=gen) / 8).to(BF), (torch.randn(64, 256, generator=gen) / 16).to(BF)
    b1 = torch.randn(256, generator=gen).to(BF) if bias else None
    b2 = torch.randn(64, generator=gen).to(BF) if bias else None
    g = torch.randn(4, 50, 64, generator=gen).to(BF)
    ref = _mlp_grads(_modules, *(t.double() if t is not None else None for t in (x, w1, b1, w2, b2)), g.double())
    ours = _mlp_grads(fused_mlp.mlp, x, w1, b1, w2, b2, g)
    theirs = _mlp_grads(_modules, x, w1, b1, w2, b2, g)
    for name, a, b, r in zip(("out", "x", "w1", "b1", "w2", "b2"), ours, theirs, ref):
        if r is None:
            assert a is None
            continue
        scale = r.abs().max().item()
        err, err_modules = (a.double() - r).abs().max().item() / scale, (b.double() - r).abs().max().item() / scale
        assert a.shape == r.shape and err <= max(2 * err_modules, 1e-2), (name, err, err_modules)


@needs_kernel
def test_only_the_asked_gradients_are_computed():
    x = torch.randn(8, 16).to(BF)
    w1, w2 = torch.randn(32, 16).to(BF), torch.randn(16, 32).to(BF).requires_grad_()
    out = fused_mlp.mlp(x, w1, None, w2, None)
    out.float().sum().backward()
    assert w2.grad is not None and w2.grad.shape == (16, 32)


@needs_kernel
def test_double_backward_says_it_is_not_supported():
    x = torch.randn(8, 16).to(BF).requires_grad_()
    w1, w2 = torch.randn(32, 16).to(BF), torch.randn(16, 32).to(BF)
    (gx,) = torch.autograd.grad(fused_mlp.mlp(x, w1, None, w2, None).float().square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.float().sum().backward()


@needs_kernel
def test_mlp_module_uses_it_in_training_only_when_nothing_observes_its_parts(monkeypatch):
    calls = []
    real = fused_mlp.mlp
    monkeypatch.setattr(fused_mlp, "mlp", lambda *a: calls.append(1) or real(*a))
    m = kernels.apply(Mlp(32, 64))
    x = torch.randn(4, 10, 32)
    with torch.autocast("cpu", dtype=BF):
        m(x)
        assert calls == [1]
        with torch.no_grad():
            m(x)  # inference: fused_linear's GELU epilogue instead
        assert calls == [1]
        seen = []
        handle = m.act.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
        m(x)
        handle.remove()
        assert calls == [1] and seen == [(4, 10, 64)]
    m(x)  # float32: the modules
    assert calls == [1]


@needs_kernel
def test_vit_training_gradients_match_the_modules(vit_bf16_grads):
    assert_grads_close(vit_bf16_grads(), vit_bf16_grads(off=(fused_mlp, "fusable")), 5e-2)

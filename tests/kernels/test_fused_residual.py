"""The one-pass residual add of a bfloat16 branch into the float32 stream, against `x + y`."""

from __future__ import annotations

import pytest
import torch

from vitscope import kernels
from vitscope.kernels import fused_add_norm, fused_residual, native
from vitscope.vit import Block

needs_kernel = pytest.mark.skipif(not native.has("avx512_bf16"),
                                  reason=f"kernels unavailable: {native.unavailable('avx512_bf16')}")


@needs_kernel
@pytest.mark.parametrize("shape", [(4, 50, 128), (3, 7), (1, 1, 17)])
def test_same_numbers_and_gradients_as_add(shape):
    x = torch.randn(shape, requires_grad=True)
    y = torch.randn(shape).to(torch.bfloat16).requires_grad_()
    assert fused_residual.fusable(x, y)
    out = fused_residual.add(x, y)
    assert out.dtype == torch.float32 and torch.equal(out, x + y)  # y widens exactly
    g = torch.randn(shape)
    out.backward(g)
    assert torch.equal(x.grad, g) and torch.equal(y.grad, g.to(torch.bfloat16))


def test_only_float32_plus_contiguous_bfloat16_of_one_shape():
    x, y = torch.randn(4, 8), torch.randn(4, 8).to(torch.bfloat16)
    assert not fused_residual.fusable(x.to(torch.bfloat16), y)
    assert not fused_residual.fusable(x, y.float())
    assert not fused_residual.fusable(x, y[:, :1].expand(4, 8))
    assert not fused_residual.fusable(x[:2], y)


@needs_kernel
def test_block_adds_through_it_only_without_layer_scale_or_drop_path(monkeypatch):
    calls = []
    for mod, name in ((fused_residual, "add"), (fused_residual, "add_"), (fused_add_norm, "add_layer_norm")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    x = torch.randn(2, 10, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kernels.apply(Block(64, 4))(x)  # the first with norm2 (fused_add_norm), the second on its own
        assert calls == ["add_layer_norm", "add"]
        with torch.no_grad():
            kernels.apply(Block(64, 4))(x)  # nothing records: the second goes into the first's sum
        assert calls[2:] == ["add_layer_norm", "add_"]
        kernels.apply(Block(64, 4, init_values=1e-5))(x)  # LayerScale: x + gamma * branch, as before
        kernels.apply(Block(64, 4, drop_path=0.5)).train()(x)
    assert len(calls) == 4


@needs_kernel
def test_add_in_place_same_numbers():
    x = torch.randn(4, 50, 128)
    y = torch.randn(4, 50, 128).to(torch.bfloat16)
    ref = x + y
    out = fused_residual.add_(x, y)
    assert out is x and torch.equal(x, ref)

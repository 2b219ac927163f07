"""LayerNorm straight to bfloat16 (C kernels) against PyTorch's float32 LayerNorm and autocast's cast."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import assert_grads_close, random_layer_norm
from vitscope import kernels
from vitscope.kernels import fused_add_norm, fused_layer_norm, native
from vitscope.vit import Block

needs_kernel = pytest.mark.skipif(not native.has("avx512_bf16"),
                                  reason=f"kernels unavailable: {native.unavailable('avx512_bf16')}")
BF = torch.bfloat16



@needs_kernel
@pytest.mark.parametrize("c", [128, 384, 40, 7])
def test_output_and_gradients_match_pytorch(c):
    norm = random_layer_norm(c)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, c, generator=gen) * 3 + 1
    g = torch.randn(3, 37, c, generator=gen).to(BF)
    with torch.autocast("cpu", dtype=BF):
        assert fused_layer_norm.fusable(x, norm)
        xa = x.clone().requires_grad_()
        ours = fused_layer_norm.layer_norm(xa, norm)
        ours.backward(g)
        mine = (ours.detach(), xa.grad, norm.weight.grad.clone(), norm.bias.grad.clone())
        norm.zero_grad()
        xb = x.clone().requires_grad_()
        theirs = norm(xb).to(BF)  # what the next linear layer casts it to
        theirs.backward(g)
    ref = (theirs.detach(), xb.grad, norm.weight.grad, norm.bias.grad)
    # the same float32 value up to summation order, rounded once: equal but for a few rounding ties
    assert mine[0].dtype == BF and (mine[0] != ref[0]).float().mean() < 0.01
    torch.testing.assert_close(mine[0], ref[0], rtol=2**-7, atol=0)  # one bfloat16 ulp
    for a, b in zip(mine[1:], ref[1:]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("c", [128, 40])
def test_a_bfloat16_stream_is_as_close_to_float64_as_pytorchs_bfloat16_layer_norm(c):
    """A residual stream autocast leaves in bfloat16: read as bfloat16, input gradient written as bfloat16.
    (PyTorch's bfloat16 LayerNorm sums the weight and bias gradients far less exactly: 2% of their size.)"""
    norm = random_layer_norm(c)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 37, c, generator=gen) * 3 + 1).to(BF)
    g = torch.randn(3, 37, c, generator=gen).to(BF)
    results = []
    for fused in (True, False):
        norm.zero_grad()
        xa = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF):
            assert fused_layer_norm.fusable(xa, norm)
            out = fused_layer_norm.layer_norm(xa, norm) if fused else norm(xa)
        out.backward(g)
        results.append((out.detach(), xa.grad, norm.weight.grad.clone(), norm.bias.grad.clone()))
    norm64 = copy.deepcopy(norm).double()
    x64 = x.double().requires_grad_()
    out64 = norm64(x64)
    out64.backward(g.double())
    ref = (out64.detach(), x64.grad, norm64.weight.grad, norm64.bias.grad)
    (mine, theirs) = results
    assert mine[0].dtype == mine[1].dtype == BF and mine[2].dtype == torch.float32
    for name, a, b, r in zip(("out", "x", "weight", "bias"), mine, theirs, ref):
        err, err_torch = (a.double() - r).abs().max().item(), (b.double() - r).abs().max().item()
        assert err <= 1.01 * err_torch + 1e-5 * r.abs().max().item(), (name, err, err_torch)


def test_not_fusable_outside_bf16_autocast_or_for_other_norms():
    norm = random_layer_norm(16)
    x = torch.randn(2, 16)
    assert not fused_layer_norm.fusable(x, norm)  # no autocast: the float32 output is what the caller gets
    with torch.autocast("cpu", dtype=BF):
        assert not fused_layer_norm.fusable(x.to(torch.float16), norm)
        assert not fused_layer_norm.fusable(x, nn.LayerNorm(16, elementwise_affine=False))
        assert not fused_layer_norm.fusable(torch.randn(2, 32)[:, ::2], norm)  # rows must be contiguous


@needs_kernel
def test_block_uses_it_only_when_nothing_could_see_the_dtype(monkeypatch):
    calls = []
    real = fused_layer_norm.layer_norm
    monkeypatch.setattr(fused_layer_norm, "layer_norm", lambda *a: calls.append(1) or real(*a))
    real_add_norm = fused_add_norm.add_layer_norm  # norm2 with the residual before it: the same kernel's pass
    monkeypatch.setattr(fused_add_norm, "add_layer_norm", lambda *a, **k: calls.append(1) or real_add_norm(*a, **k))
    block = kernels.apply(Block(64, 4))
    x = torch.randn(2, 10, 64)
    with torch.autocast("cpu", dtype=BF):
        block(x)
        assert len(calls) == 2
        seen = []
        handle = block.mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        block(x)
        handle.remove()
        assert len(calls) == 3 and seen == [torch.float32]  # norm2 unfused: its consumer's hook sees float32
        block.mlp.fc1 = nn.Linear(64, 256)  # a replaced first layer gets what nn.LayerNorm gives
        block(x)
        assert len(calls) == 4
    block(x)
    assert len(calls) == 4


@needs_kernel
def test_vit_training_gradients_match_pytorch_layer_norm(vit_bf16_grads):
    assert_grads_close(vit_bf16_grads(), vit_bf16_grads(off=(fused_layer_norm, "fusable")), 1e-2)

"""The residual add and the LayerNorm after it in one pass, against the two kernels apart and PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import random_layer_norm
from vitscope import kernels
from vitscope.kernels import fused_add_norm, fused_layer_norm, fused_residual, native
from vitscope.vit import Block

BF = torch.bfloat16
needs_kernel = pytest.mark.skipif(native.unavailable("avx512_bf16") is not None,
                                  reason=f"bfloat16 kernels unavailable: {native.unavailable('avx512_bf16')}")



def _inputs(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3 + 1
    branch = (torch.randn(shape, generator=gen) * 2).to(BF)
    return x, branch


@needs_kernel
@pytest.mark.parametrize("shape", [(3, 37, 384), (2, 50, 128), (5, 40), (1, 3, 7)])
def test_same_numbers_and_gradients_as_the_two_kernels(shape):
    """The sum and the normalised rows are bit for bit the residual kernel's and the LayerNorm kernel's;
    so are all four gradients, the sum's own gradient added to LayerNorm's in the same pass."""
    norm = random_layer_norm(shape[-1])
    x, branch = _inputs(shape)
    gen = torch.Generator().manual_seed(2)
    ds, dy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen).to(BF)
    with torch.autocast("cpu", dtype=BF):
        assert fused_add_norm.fusable(x, branch, norm)
        xa, ba = x.clone().requires_grad_(), branch.clone().requires_grad_()
        s, y = fused_add_norm.add_layer_norm(xa, ba, norm)
        torch.autograd.backward([s, y], [ds, dy])
        ours = (s.detach(), y.detach(), xa.grad, ba.grad, norm.weight.grad.clone(), norm.bias.grad.clone())
        norm.zero_grad()
        xb, bb = x.clone().requires_grad_(), branch.clone().requires_grad_()
        s2 = fused_residual.add(xb, bb)
        y2 = fused_layer_norm.layer_norm(s2, norm)
        torch.autograd.backward([s2, y2], [ds, dy])
        theirs = (s2.detach(), y2.detach(), xb.grad, bb.grad, norm.weight.grad, norm.bias.grad)
    assert s.dtype == torch.float32 and y.dtype == BF and ba.grad.dtype == BF
    for name, a, b in zip(["sum", "out", "dx", "dbranch", "dweight", "dbias"], ours, theirs):
        assert torch.equal(a, b), name


@needs_kernel
def test_close_to_float64():
    """Against the same add and LayerNorm in float64: the output within bfloat16's rounding, the input
    gradient within float32 summation error."""
    norm = random_layer_norm(384)
    x, branch = _inputs((2, 50, 384))
    dy = torch.randn(2, 50, 384).to(BF)
    with torch.autocast("cpu", dtype=BF):
        xa = x.clone().requires_grad_()
        s, y = fused_add_norm.add_layer_norm(xa, branch, norm)
        y.backward(dy)
    x64 = x.double().requires_grad_()
    ref = nn.functional.layer_norm(x64 + branch.double(), (384,), norm.weight.double(), norm.bias.double(), 1e-6)
    ref.backward(dy.double())
    assert torch.equal(s, x + branch.float())
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()  # half a bfloat16 ulp, and float32's
    assert (xa.grad.double() - x64.grad).abs().max() / x64.grad.abs().max() < 1e-5


@needs_kernel
def test_inference_needs_no_statistics():
    norm = random_layer_norm(128)
    x, branch = _inputs((4, 9, 128))
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF):
        s, y = fused_add_norm.add_layer_norm(x, branch, norm)
        ref = fused_layer_norm.layer_norm(fused_residual.add(x, branch), norm)
    assert torch.equal(y, ref) and torch.equal(s, x + branch.float())


def test_only_where_both_kernels_would_run():
    norm = random_layer_norm(64)
    x, branch = _inputs((4, 8, 64))
    assert not fused_add_norm.fusable(x, branch, norm)  # no autocast
    with torch.autocast("cpu", dtype=BF):
        assert not fused_add_norm.fusable(x.to(BF), branch, norm)  # a bfloat16 stream
        assert not fused_add_norm.fusable(x, branch.float(), norm)
        assert not fused_add_norm.fusable(x[:, :1], branch[:, :1], norm)  # not contiguous
        assert not fused_add_norm.fusable(x, branch, nn.LayerNorm(64, elementwise_affine=False))
        assert not fused_add_norm.fusable(x, branch, nn.RMSNorm(64))


def _block(seed=0):
    torch.manual_seed(seed)
    block = kernels.apply(Block(128, 4))
    for p in block.parameters():
        nn.init.normal_(p, std=0.1)
    return block


@needs_kernel
def test_block_training_same_as_without_it(monkeypatch):
    """A block's output and every gradient are the same with the fused add and norm as with the residual
    and LayerNorm kernels apart."""
    block = _block()
    other = copy.deepcopy(block)
    x = torch.randn(3, 20, 128)
    g = torch.randn(3, 20, 128)
    calls = []
    real = fused_add_norm.add_layer_norm
    monkeypatch.setattr(fused_add_norm, "add_layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.autocast("cpu", dtype=BF):
        xa = x.clone().requires_grad_()
        out = block(xa)
        out.backward(g)
        assert len(calls) == 1
        monkeypatch.setattr(fused_add_norm, "fusable", lambda *a: False)
        xb = x.clone().requires_grad_()
        ref = other(xb)
        ref.backward(g)
    assert len(calls) == 1 and torch.equal(out, ref) and torch.equal(xa.grad, xb.grad)
    for (name, p), q in zip(block.named_parameters(), other.parameters()):
        assert torch.equal(p.grad, q.grad), name


@needs_kernel
def test_block_inference_adds_in_place_into_its_own_sum_only(monkeypatch):
    """In inference the MLP's residual goes into the block's own x + attn, never into the block's input;
    the output is the same as without the fusion."""
    block = _block().eval()
    x = torch.randn(2, 20, 128)
    kept = x.clone()
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF):
        out = block(x)
        monkeypatch.setattr(fused_add_norm, "fusable", lambda *a: False)
        ref = block(x)
    assert torch.equal(x, kept) and torch.equal(out, ref)


@needs_kernel
def test_block_keeps_them_apart_where_hooks_watch(monkeypatch):
    calls = []
    real = fused_add_norm.add_layer_norm
    monkeypatch.setattr(fused_add_norm, "add_layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    block = _block()
    seen = []
    block.norm2.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast("cpu", dtype=BF):
        block(torch.randn(2, 10, 128))
        kernels.apply(Block(128, 4, init_values=1e-5))(torch.randn(2, 10, 128))  # LayerScale on the branch
        kernels.apply(Block(128, 4, drop_path=0.5)).train()(torch.randn(2, 10, 128))
    assert not calls and seen == [torch.float32]


@needs_kernel
def test_model_logits_and_gradients_same_as_without_it(vit_bf16_grads, monkeypatch):
    """A whole ViT (its last block computing the class token alone) gives the same logits in inference
    and the same gradients in training with the fusion as without."""
    from vitscope.models import create_model

    assert all(torch.equal(a, b) for a, b in zip(vit_bf16_grads().values(),
                                                  vit_bf16_grads(off=(fused_add_norm, "fusable")).values()))
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=3, kernels=True).eval()
    x = torch.randn(8, 1, 28, 28)
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF):
        out = model(x)
        feats = model.forward_features(x)
        monkeypatch.setattr(fused_add_norm, "fusable", lambda *a: False)
        assert torch.equal(out, model(x)) and torch.equal(feats, model.forward_features(x))


@needs_kernel
def test_model_loop_chains_blocks_only_where_nothing_hooks_them(monkeypatch):
    """In a model's loop each block's second residual shares a pass with the next block's norm1; a hook on
    any block makes the loop call each block as a module again, and the hook sees every output."""
    from vitscope.models import create_model

    calls = []
    real = fused_add_norm.add_layer_norm
    monkeypatch.setattr(fused_add_norm, "add_layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=3, kernels=True).eval()
    x = torch.randn(4, 1, 28, 28)
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF):
        out = model.forward_features(x)
        assert len(calls) == 3 + 2  # each block's first residual with norm2, and two links between blocks
        logits = model(x)  # the last block's class token alone: its first residual reads a slice, apart
        assert len(calls) == 5 + 2 + 2
        seen = []
        handle = model.blocks[1].register_forward_hook(lambda m, i, o: seen.append(o.clone()))
        hooked, hooked_logits = model.forward_features(x), model(x)
        handle.remove()
    assert len(calls) == 9 + 3 + 2 and len(seen) == 2
    assert torch.equal(out, hooked) and torch.equal(logits, hooked_logits)


def test_model_loop_takes_blocks_of_other_kinds():
    """A block replaced by another module makes the loop call each block as a module, with `queries` only
    for the last block where the model's head reads the class token alone."""
    from vitscope.models import create_model

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=3, kernels=True).eval()
    x = torch.randn(2, 1, 28, 28)
    model.blocks[1] = nn.Identity()
    with torch.inference_mode():
        assert model.forward_features(x).shape == (2, 50, model.config.embed_dim)
        assert model(x).shape == (2, 10)

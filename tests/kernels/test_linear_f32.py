"""vitscope's float32 linear products (native/linear_f32_avx2.c, CPUs with AVX2 and no AVX-512) against float64:
the forward x Wᵀ + b, the input gradient g W, the weight and bias gradients, at shapes with partial tiles,
strided rows and 1 or 2 threads; when fused_linear's float32 path takes them; and a ViT's float32 gradients
with them against nn.Linear's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitscope import kernels
from vitscope.kernels import fused_linear, linear_f32, registry
from vitscope.vit import VisionTransformer, ViTConfig

needs_kernel = pytest.mark.skipif(not linear_f32.usable(),
                                  reason=f"float32 linear kernel off: {registry.why_none('linear', torch.float32)}")

# (M, k, n): whole 96-row chunks and partial ones, 6-row tiles and their tails, panels of 16 and a last one of
# 8, reductions of 1 to 512 (the plain ViT's fc2) and one of three blocks (1100 = 512 + 512 + 76), a single row;
# the weight gradient's 64-row chunks, whole and partial, per thread
SHAPES = [(1, 8, 8), (7, 1, 24), (50, 13, 40), (97, 128, 384), (300, 512, 128), (131, 64, 136), (45, 1100, 24)]


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref).abs().max().item() / ref.abs().max().item()


def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_products_are_as_close_to_float64_as_torchs(shape, threads):
    m, k, n = shape
    gen = torch.Generator().manual_seed(m * k + n)
    x, w, b, g = (torch.randn(*s, generator=gen) for s in ((m, k), (n, k), (n,), (m, n)))
    before = _threads(threads)
    try:
        assert linear_f32.runnable(x, w, b) and linear_f32.runnable(g, w, forward=False) == (k % 8 == 0)
        y = linear_f32.forward(x, w, b)
        ref = x.double() @ w.double().t() + b.double()
        # float32 sums in another order: within a few times torch's own distance from float64
        assert y.shape == (m, n) and _err(y, ref) <= 4 * _err(F.linear(x, w, b), ref) + 1e-7
        assert _err(linear_f32.forward(x, w), x.double() @ w.double().t()) < 1e-5
        if k % 8 == 0:
            gx, ref_x = linear_f32.input_grad(g, w), g.double() @ w.double()
            assert gx.shape == (m, k) and _err(gx, ref_x) <= 4 * _err(g @ w, ref_x) + 1e-7
        assert linear_f32.weight_grad_runnable(g, x) == (k % 8 == 0)
        if k % 8 == 0:
            dw, db = linear_f32.weight_and_bias_grad(g, x, bias=True)
            ref_w = g.double().t() @ x.double()
            assert dw.shape == (n, k) and _err(dw, ref_w) <= 4 * _err(g.t() @ x, ref_w) + 1e-7
            assert db.shape == (n,) and _err(db, g.double().sum(0)) < 1e-6
            dw2, none = linear_f32.weight_and_bias_grad(g, x, bias=False)
            assert none is None and torch.equal(dw, dw2)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_strided_rows_and_weights():
    gen = torch.Generator().manual_seed(1)
    big, wbig = torch.randn(64, 100, generator=gen), torch.randn(48, 90, generator=gen)
    x, w, b = big[:, 3:67], wbig[:, 5:69], torch.randn(96, generator=gen)[::2]  # row strides 100 and 90; b strided
    g = torch.randn(64, 120, generator=gen)[:, 7:55]  # (64, 48) at row stride 120
    assert linear_f32.runnable(x, w, b) and linear_f32.runnable(g, w, forward=False)
    assert torch.allclose(linear_f32.forward(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.allclose(linear_f32.input_grad(g, w), g @ w, rtol=1e-5, atol=1e-5)
    dw, db = linear_f32.weight_and_bias_grad(g, x, bias=True)
    assert torch.allclose(dw, g.t() @ x, rtol=1e-5, atol=1e-4) and torch.allclose(db, g.sum(0), atol=1e-5)


@needs_kernel
def test_other_inputs_are_left_to_torch():
    x, w = torch.randn(10, 16), torch.randn(24, 16)
    assert not linear_f32.runnable(x, torch.randn(20, 16))  # 20 columns: not a multiple of 8
    assert not linear_f32.runnable(x.bfloat16(), w.bfloat16())
    assert not linear_f32.runnable(x.double(), w.double())
    assert not linear_f32.runnable(x.t().contiguous().t(), w)  # columns apart
    assert not linear_f32.runnable(x, w, torch.randn(23))  # a bias of the wrong length
    assert not linear_f32.runnable(torch.randn(0, 16), w)
    assert not linear_f32.runnable(torch.randn(10, 15), w)  # F.linear's shape error, not the kernel's
    assert not linear_f32.runnable(torch.randn(2, 10, 16), w)  # fused_linear passes rows
    assert not linear_f32.weight_grad_runnable(torch.randn(10, 24), torch.randn(10, 20))  # in 20
    assert not linear_f32.weight_grad_runnable(torch.randn(10, 24), torch.randn(11, 16))


def _gelu_and_grad64(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = a.double()
    cdf = 0.5 * torch.special.erfc(-a / 2**0.5)
    return a * cdf, cdf + a * torch.exp(-a * a / 2) / (2 * torch.pi) ** 0.5


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(50, 64, 256), (7, 1100, 24), (97, 128, 512)])
def test_gelu_epilogue_and_the_multiply(shape, threads):
    m, k, n = shape
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * k**-0.5
    b = torch.randn(n, generator=gen)
    before = _threads(threads)
    try:
        h, d = linear_f32.forward_gelu(x, w, b)
        a = F.linear(x, w, b)  # the pre-activation, as the kernel's own sums round it (to float32 rounding)
        ref_h, ref_d = _gelu_and_grad64(x.double() @ w.double().t() + b.double())
        # within a few times the distance from float64 of torch's float32 GELU of torch's float32 product (as the
        # products alone: the sums' order differs)
        assert _err(h, ref_h) <= 4 * _err(F.gelu(a), ref_h) + 1e-7
        assert _err(d, ref_d) <= 4 * _err(_gelu_and_grad64(a)[1].float(), ref_d) + 1e-7
        g, mul = torch.randn(m, k, generator=gen), torch.rand(n, m, generator=gen).t()  # mul: columns apart
        wt = torch.randn(k, n, generator=gen)  # a weight (out, in) = (k, n): g W is (m, n)
        ref = (g.double() @ wt.double()) * mul.double()
        assert _err(linear_f32.input_grad(g, wt, mul=mul), ref) <= 4 * _err((g @ wt) * mul, ref) + 1e-7
        with pytest.raises(ValueError, match="multiplier"):
            linear_f32.input_grad(g, wt, mul=mul[:-1])
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.skipif(not fused_linear.float32_available(), reason="fused_linear's float32 path is off on this CPU")
def test_float32_mlp_keeps_gelus_value_and_derivative_with_autograds_numbers():
    from vitscope.kernels import fused_mlp

    torch.manual_seed(0)
    x = torch.randn(3, 50, 64, requires_grad=True)
    params = [torch.randn(256, 64) * 0.1, torch.randn(256), torch.randn(64, 256) * 0.1, torch.randn(64)]
    w1, b1, w2, b2 = (p.requires_grad_() for p in params)
    assert fused_mlp.fusable(x, w1, b1, w2, b2)
    assert not fused_mlp.fusable(x, w1[:250], b1[:250], w2[:, :250], b2)  # hidden 250: torch's modules
    g = torch.randn(3, 50, 64)
    ours = torch.autograd.grad(fused_mlp.mlp(x, w1, b1, w2, b2), (x, w1, b1, w2, b2), g)
    theirs = torch.autograd.grad(F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), (x, w1, b1, w2, b2), g)
    xd = [t.detach().double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    exact = torch.autograd.grad(F.linear(F.gelu(F.linear(xd[0], xd[1], xd[2])), xd[3], xd[4]), xd, g.double())
    for o, t, e in zip(ours, theirs, exact):
        assert o.shape == e.shape and _err(o, e) <= 3 * _err(t, e) + 1e-7
    with torch.no_grad():  # inference: no gradient recorded, so the MLP is not taken
        assert not fused_mlp.fusable(x, w1, b1, w2, b2)


@pytest.fixture
def calls(monkeypatch):
    """Counts the kernel's calls by product."""
    seen: list[str] = []
    for name in ("forward", "forward_gelu", "input_grad", "weight_and_bias_grad"):
        fn = getattr(linear_f32, name)

        def counting(*args, _fn=fn, _name=name, **kwargs):
            seen.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(linear_f32, name, counting)
    return seen


@needs_kernel
@pytest.mark.skipif(not fused_linear.float32_available(), reason="fused_linear's float32 path is off on this CPU")
def test_vit_float32_training_takes_every_product_here_with_nn_linears_gradients(calls, monkeypatch):
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4)
    model = kernels.apply(VisionTransformer(cfg))
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model(x)
        F.cross_entropy(logits, y).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logits, grads = step()
    # qkv/proj/fc2 of both blocks forward, fc1 with its GELU, and their backwards; the head's backward too (its
    # forward's 10 columns stay oneDNN's); the patch embedding is a convolution
    assert calls.count("forward") == 6 and calls.count("forward_gelu") == 2
    assert calls.count("input_grad") == 9 and calls.count("weight_and_bias_grad") == 9
    monkeypatch.setattr(fused_linear, "float32_fusable", lambda *a: False)
    ref_logits, ref = step()
    assert torch.allclose(logits, ref_logits, rtol=1e-4, atol=1e-5)
    assert grads.keys() == ref.keys()
    for name in grads:
        scale = ref[name].abs().max()
        assert scale > 0 and (grads[name] - ref[name]).abs().max() <= 1e-4 * scale, name

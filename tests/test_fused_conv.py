"""vitscope/fused_conv.py: the conv's weight gradient from native/conv_weight_grad.c, against float64 and
against oneDNN's convolution backward (the reference we did not write)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitscope import fused_conv, native
from vitscope.models import create_model

BF = torch.bfloat16
CL = torch.channels_last

needs_kernel = pytest.mark.skipif(not native.has("avx512_bf16"),
                                  reason=f"vitscope's kernels unavailable: {native.why_not('avx512_bf16')}")


def _t(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(BF).contiguous(memory_format=CL)


def _reference(g, x, w, stride, pad):
    """aten's weight gradient in float64, and in bfloat16 (oneDNN's)."""
    def dw(dtype):
        return torch.ops.aten.convolution_backward(g.to(dtype), x.to(dtype), w.to(dtype), None, [stride] * 2,
                                                   [pad] * 2, [1, 1], False, [0, 0], 1, [False, True, False])[1]
    return dw(torch.float64), dw(BF)


SHAPES = [  # n, c, o, h, w, k, stride, pad
    (5, 32, 64, 9, 7, 3, 2, 1),     # odd rows (5·5·4 = 100: even, but the chunks split unevenly), stride 2
    (3, 64, 32, 7, 7, 3, 1, 1),     # 147 rows: the last pair has one row
    (2, 32, 32, 6, 5, 3, 1, 0),     # no padding
    (4, 96, 64, 8, 8, 1, 1, 0),     # 1 x 1: a linear map of each pixel
    (2, 32, 128, 12, 10, 2, 2, 0),  # patchify: kernel = stride
    (3, 64, 32, 9, 8, 2, 2, 0),     # the last input column read by no output
    (2, 32, 64, 10, 11, 5, 3, 2),   # stride 3, a 5 x 5 filter
    (7, 128, 128, 7, 7, 3, 1, 1),   # the quick preset's last stem conv, a small batch
    (1, 32, 32, 3, 3, 5, 1, 2),     # the filter wider than the image: every row pads
]


def _case(n, c, o, h, w, k, stride, pad):
    x, wt = _t(n, c, h, w), _t(o, c, k, k, seed=1)
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    return x, wt, _t(n, o, oh, ow, seed=2)


@needs_kernel
@pytest.mark.parametrize("n,c,o,h,w,k,stride,pad", SHAPES)
def test_the_weight_gradient_is_the_float64_one_rounded_once(n, c, o, h, w, k, stride, pad):
    x, wt, g = _case(n, c, o, h, w, k, stride, pad)
    ours = fused_conv.weight_grad(g, x, wt.shape, stride, pad)
    exact, onednn = _reference(g, x, wt, stride, pad)
    assert ours.dtype == BF and ours.shape == wt.shape and ours.is_contiguous(memory_format=CL)
    # float32 sums rounded once to bfloat16: within half a bfloat16 step of the exact value (a little
    # more for the float32 sums' own rounding), and never further from it than oneDNN's result
    torch.testing.assert_close(ours.double(), exact, rtol=2 ** -8, atol=1e-6 * exact.abs().max().item())
    assert (ours.double() - exact).abs().max() <= (onednn.double() - exact).abs().max() * 1.01 + 1e-12


def _stem_conv(c=32, o=64, stride=2, **kw):
    torch.manual_seed(0)
    return nn.Conv2d(c, o, 3, stride, 1, bias=False, **kw).to(memory_format=CL)


def _grads(conv, x, g, use_kernel, monkeypatch):
    monkeypatch.setattr(fused_conv, "fusable", (lambda *a: True) if use_kernel else (lambda *a: False))
    x = x.detach().clone().requires_grad_()
    conv.zero_grad()
    with torch.autocast("cpu", dtype=BF):
        out = fused_conv.conv2d(x, conv) if use_kernel else conv(x)
    out.backward(g)
    return out.detach(), x.grad, conv.weight.grad.clone()


@needs_kernel
@pytest.mark.parametrize("stride", [1, 2])
def test_training_under_autocast_matches_onednn(stride, monkeypatch):
    conv = _stem_conv(stride=stride)
    x = torch.randn(6, 32, 10, 9).contiguous(memory_format=CL)
    with torch.autocast("cpu", dtype=BF):
        shape = conv(x).shape
    g = _t(*shape, seed=3)
    out, gx, gw = _grads(conv, x, g, True, monkeypatch)
    ref_out, ref_gx, ref_gw = _grads(conv, x, g, False, monkeypatch)
    assert out.dtype == ref_out.dtype == BF
    assert torch.equal(out, ref_out)  # the same oneDNN forward
    assert torch.equal(gx, ref_gx)  # the same oneDNN input gradient, cast back to float32 by autograd
    assert gw.dtype == torch.float32 and gw.shape == conv.weight.shape
    exact = torch.ops.aten.convolution_backward(g.double(), x.to(BF).double(), conv.weight.to(BF).double(), None,
                                                [stride] * 2, [1, 1], [1, 1], False, [0, 0], 1,
                                                [False, True, False])[1]
    torch.testing.assert_close(gw.double(), exact, rtol=2 ** -8, atol=1e-6 * exact.abs().max().item())
    # oneDNN's, within a bfloat16 step (of the value, or of the largest one where sums cancel)
    torch.testing.assert_close(gw, ref_gw, rtol=2 ** -7, atol=2 ** -8 * ref_gw.abs().max().item())


@needs_kernel
def test_without_an_input_gradient_only_the_weight_gradient_is_taken():
    conv = _stem_conv()
    x = _t(2, 32, 8, 8)
    with torch.autocast("cpu", dtype=BF):
        fused_conv.conv2d(x, conv).float().sum().backward()
    assert conv.weight.grad is not None and x.grad is None


@needs_kernel
def test_double_backward_raises():
    conv = _stem_conv()
    x = _t(2, 32, 8, 8).requires_grad_()
    with torch.autocast("cpu", dtype=BF):
        (gx,) = torch.autograd.grad(fused_conv.conv2d(x, conv).float().square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.float().sum().backward()


@needs_kernel
@pytest.mark.parametrize("case", ["float32", "no_grad", "frozen", "bias", "groups", "dilation", "channels_24",
                                  "out_48", "same", "uneven_padding", "uneven_stride", "reflect", "subclass"])
def test_onednn_keeps_the_conv_where_the_kernel_does_not_apply(case):
    conv, x, autocast = _stem_conv(), _t(2, 32, 8, 8), True
    if case == "float32":
        x, autocast = x.float(), False
    elif case == "frozen":
        conv.weight.requires_grad_(False)
    elif case == "bias":
        conv = nn.Conv2d(32, 64, 3, 1, 1)
    elif case == "groups":
        conv = nn.Conv2d(32, 64, 3, 1, 1, groups=2, bias=False)
    elif case == "dilation":
        conv = nn.Conv2d(32, 64, 3, 1, 2, dilation=2, bias=False)
    elif case == "channels_24":
        conv, x = nn.Conv2d(24, 64, 3, 1, 1, bias=False), _t(2, 24, 8, 8)
    elif case == "out_48":
        conv = nn.Conv2d(32, 48, 3, 1, 1, bias=False)
    elif case == "same":
        conv = nn.Conv2d(32, 64, 3, 1, "same", bias=False)
    elif case == "uneven_padding":
        conv = nn.Conv2d(32, 64, 3, 1, (1, 0), bias=False)
    elif case == "uneven_stride":
        conv = nn.Conv2d(32, 64, 3, (2, 1), 1, bias=False)
    elif case == "reflect":
        conv = nn.Conv2d(32, 64, 3, 1, 1, bias=False, padding_mode="reflect")
    elif case == "subclass":
        conv = type("MyConv", (nn.Conv2d,), {})(32, 64, 3, 1, 1, bias=False)
    with torch.autocast("cpu", dtype=BF, enabled=autocast), torch.set_grad_enabled(case != "no_grad"):
        assert not fused_conv.fusable(x, conv)
    with torch.autocast("cpu", dtype=BF):
        assert fused_conv.fusable(_t(2, 32, 8, 8), _stem_conv()) == ("amx_bf16" not in native.cpu_features())


@needs_kernel
def test_the_conv_stem_takes_its_weight_gradients_from_the_kernel_unless_hooked(monkeypatch):
    if "amx_bf16" in native.cpu_features():
        pytest.skip("oneDNN keeps the stem's convs where the CPU has AMX")
    calls = []
    kernel = fused_conv.weight_grad
    monkeypatch.setattr(fused_conv, "weight_grad", lambda g, x, *a: calls.append(x.shape[1]) or kernel(g, x, *a))
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick")
    x = torch.randn(4, 1, 28, 28)
    with torch.autocast("cpu", dtype=BF):
        model(x).float().sum().backward()
    ins = [c for c, _ in model.config.stem][:-1]  # each conv's input channels after the first (1 channel)
    assert sorted(calls) == sorted(ins)
    calls.clear()
    model.patch_embed.stem[3].register_forward_hook(lambda m, i, o: None)  # the second conv
    with torch.autocast("cpu", dtype=BF):
        model(x).float().sum().backward()
    assert sorted(calls) == sorted(ins[1:])
    with torch.no_grad(), torch.autocast("cpu", dtype=BF):
        model(x)  # inference: oneDNN's forward alone
    assert sorted(calls) == sorted(ins[1:])


@needs_kernel
def test_a_training_step_of_the_quick_model_gives_onednns_gradients(monkeypatch):
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick")
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def grads(use_kernel):
        monkeypatch.setattr(fused_conv, "fusable", fused_conv.fusable if use_kernel else (lambda *a: False))
        model.zero_grad()
        with torch.autocast("cpu", dtype=BF):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    shipped = fused_conv.fusable
    loss, ours = grads(True)
    monkeypatch.setattr(fused_conv, "fusable", shipped)
    ref_loss, theirs = grads(False)
    assert torch.equal(loss, ref_loss)
    for name, g in ours.items():
        scale = theirs[name].abs().max().item()
        # the stem's weight gradients differ by the order of float32 sums and flow back into the earlier
        # convs' input gradients only through the weights' own values, so everything stays within bfloat16 noise
        torch.testing.assert_close(g, theirs[name], rtol=0, atol=2 ** -7 * scale, msg=name)

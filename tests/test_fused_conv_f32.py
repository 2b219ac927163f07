"""vitscope/fused_conv.py's float32 path: the conv's weight gradient from native/conv_weight_grad_f32_avx2.c,
against float64 and against oneDNN's float32 convolution backward (the reference we did not write)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitscope import fused_conv, fused_linear, linear_f32
from vitscope.models import create_model

CL = torch.channels_last

needs_kernel = pytest.mark.skipif(not (fused_linear.float32_available() and linear_f32.usable()),
                                  reason="the float32 conv kernel runs on AMD CPUs with AVX2 and without AVX-512")


def _t(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).contiguous(memory_format=CL)


def _reference(g, x, w, stride, pad, dtype):
    return torch.ops.aten.convolution_backward(g.to(dtype), x.to(dtype), w.to(dtype), None, [stride] * 2,
                                               [pad] * 2, [1, 1], False, [0, 0], 1, [False, True, False])[1]


SHAPES = [  # n, c, o, h, w, k, stride, pad
    (5, 32, 64, 9, 7, 3, 2, 1),     # stride 2, a non-square image
    (3, 64, 30, 7, 7, 3, 1, 1),     # o not a multiple of 6: the last block of g's columns is part zeros
    (2, 16, 7, 6, 5, 3, 1, 0),      # no padding, 16 channels (one panel a tap), o = 7
    (4, 48, 64, 8, 8, 1, 1, 0),     # 1 x 1: a linear map of each pixel
    (2, 32, 128, 12, 10, 2, 2, 0),  # patchify: kernel = stride
    (3, 64, 32, 9, 8, 2, 2, 0),     # the last input column read by no output
    (2, 32, 64, 10, 11, 5, 3, 2),   # stride 3, a 5 x 5 filter
    (7, 128, 128, 7, 7, 3, 1, 1),   # the quick preset's last stem conv, a small batch
    (1, 32, 1, 3, 3, 5, 1, 2),      # the filter wider than the image, one output channel
    (40, 16, 12, 6, 6, 3, 1, 1),    # 1,440 pixels: many chunks of rows per thread
    (0, 32, 64, 8, 8, 3, 1, 1),     # an empty batch: zeros
]


def _case(n, c, o, h, w, k, stride, pad):
    x, wt = _t(n, c, h, w), _t(o, c, k, k, seed=1)
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    return x, wt, _t(n, o, oh, ow, seed=2)


@needs_kernel
@pytest.mark.parametrize("n,c,o,h,w,k,stride,pad", SHAPES)
def test_the_weight_gradient_matches_float64_at_least_as_well_as_onednn(n, c, o, h, w, k, stride, pad):
    x, wt, g = _case(n, c, o, h, w, k, stride, pad)
    ours = fused_conv.weight_grad_f32(g, x, wt.shape, stride, pad)
    exact, onednn = _reference(g, x, wt, stride, pad, torch.float64), _reference(g, x, wt, stride, pad, torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == wt.shape and ours.is_contiguous(memory_format=CL)
    if n == 0:
        assert torch.equal(ours, torch.zeros_like(ours))
        return
    scale = exact.abs().max().item()
    torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-6 * scale)
    assert (ours.double() - exact).abs().max() <= (onednn.double() - exact).abs().max() * 1.5 + 1e-7 * scale


@needs_kernel
def test_one_thread_gives_the_same_sums_as_a_thread_per_core_would_within_rounding():
    x, wt, g = _case(6, 32, 64, 9, 9, 3, 1, 1)
    many = fused_conv.weight_grad_f32(g, x, wt.shape, 1, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = fused_conv.weight_grad_f32(g, x, wt.shape, 1, 1)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, many, rtol=1e-5, atol=1e-5 * many.abs().max().item())


def _stem_conv(c=32, o=64, stride=2, **kw):
    torch.manual_seed(0)
    return nn.Conv2d(c, o, 3, stride, 1, bias=False, **kw).to(memory_format=CL)


@needs_kernel
@pytest.mark.parametrize("stride", [1, 2])
def test_training_matches_onednn(stride):
    conv = _stem_conv(stride=stride)
    x = torch.randn(6, 32, 10, 9).contiguous(memory_format=CL)
    g = _t(*conv(x).shape, seed=3)

    def run(use_kernel):
        xx = x.clone().requires_grad_()
        conv.zero_grad()
        out = fused_conv.conv2d(xx, conv) if use_kernel else conv(xx)
        out.backward(g)
        return out.detach(), xx.grad, conv.weight.grad.clone()

    assert fused_conv.fusable(x, conv)
    out, gx, gw = run(True)
    ref_out, ref_gx, ref_gw = run(False)
    assert torch.equal(out, ref_out)  # the same oneDNN forward
    assert torch.equal(gx, ref_gx)  # the same oneDNN input gradient
    assert gw.dtype == torch.float32 and gw.shape == conv.weight.shape
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-5 * ref_gw.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("case", ["no_grad", "frozen", "bias", "channels_24", "autocast", "float64", "bfloat16",
                                  "mixed", "same", "uneven_stride", "dilation"])
def test_onednn_keeps_the_conv_where_the_float32_kernel_does_not_apply(case):
    conv, x, autocast = _stem_conv(), _t(2, 32, 8, 8), False
    if case == "frozen":
        conv.weight.requires_grad_(False)
    elif case == "bias":
        conv = nn.Conv2d(32, 64, 3, 1, 1)
    elif case == "channels_24":
        conv, x = nn.Conv2d(24, 64, 3, 1, 1, bias=False), _t(2, 24, 8, 8)
    elif case == "autocast":
        autocast = True
    elif case == "float64":
        conv, x = conv.double(), x.double()
    elif case == "bfloat16":
        conv, x = conv.bfloat16(), x.bfloat16()
    elif case == "mixed":
        x = x.double()
    elif case == "same":
        conv = nn.Conv2d(32, 64, 3, 1, "same", bias=False)
    elif case == "uneven_stride":
        conv = nn.Conv2d(32, 64, 3, (2, 1), 1, bias=False)
    elif case == "dilation":
        conv = nn.Conv2d(32, 64, 3, 1, 2, dilation=2, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(case != "no_grad"):
        assert not fused_conv.fusable(x, conv)
    assert fused_conv.fusable(_t(2, 32, 8, 8), _stem_conv())


@needs_kernel
def test_the_conv_stem_takes_its_float32_weight_gradients_from_the_kernel_unless_hooked(monkeypatch):
    calls = []
    kernel = fused_conv.weight_grad_f32
    monkeypatch.setattr(fused_conv, "weight_grad_f32", lambda g, x, *a: calls.append(x.shape[1]) or kernel(g, x, *a))
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick")
    x = torch.randn(4, 1, 28, 28)
    model(x).sum().backward()
    ins = [c for c, _ in model.config.stem][:-1]  # each conv's input channels after the first (1 channel)
    assert sorted(calls) == sorted(ins)
    calls.clear()
    model.patch_embed.stem[3].register_forward_hook(lambda m, i, o: None)  # the second conv
    model(x).sum().backward()
    assert sorted(calls) == sorted(ins[1:])
    with torch.no_grad():
        model(x)  # inference: oneDNN's forward alone
    assert sorted(calls) == sorted(ins[1:])


@needs_kernel
def test_a_float32_training_step_of_the_quick_model_gives_onednns_gradients(monkeypatch):
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick")
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    shipped = fused_conv.fusable

    def grads(use_kernel):
        monkeypatch.setattr(fused_conv, "fusable", shipped if use_kernel else (lambda *a: False))
        model.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, ours = grads(True)
    ref_loss, theirs = grads(False)
    assert torch.equal(loss, ref_loss)
    for name, g in ours.items():
        # only the order of float32 sums differs, in the stem's weight gradients
        torch.testing.assert_close(g, theirs[name], rtol=0, atol=1e-5 * theirs[name].abs().max().item(), msg=name)

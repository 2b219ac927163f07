"""vitscope/kernels/fused_conv.py: the conv's weight gradient from native/conv_weight_grad.c (bfloat16) and
native/conv_weight_grad_f32_avx2.c (float32), against float64 and against oneDNN's convolution backward (the
reference we did not write)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitscope.kernels import fused_conv, fused_linear, native
from vitscope.models import create_model

BF = torch.bfloat16
CL = torch.channels_last

needs_kernel = pytest.mark.skipif(not native.has("avx512_bf16"),
                                  reason=f"vitscope's kernels unavailable: {native.unavailable('avx512_bf16')}")


needs_f32_kernel = pytest.mark.skipif(not fused_linear.float32_kernels(),
                                      reason="the float32 conv kernel runs on AMD CPUs with AVX2 and without AVX-512")


def _t(*shape, seed=0, dtype=BF):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).contiguous(memory_format=CL)


def _reference(g, x, w, stride, pad, dtype=BF):
    """aten's weight gradient in float64, and in `dtype` (oneDNN's)."""
    def dw(dt):
        return torch.ops.aten.convolution_backward(g.to(dt), x.to(dt), w.to(dt), None, [stride] * 2,
                                                   [pad] * 2, [1, 1], False, [0, 0], 1, [False, True, False])[1]
    return dw(torch.float64), dw(dtype)


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


def _case(n, c, o, h, w, k, stride, pad, dtype=BF):
    x, wt = _t(n, c, h, w, dtype=dtype), _t(o, c, k, k, seed=1, dtype=dtype)
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    return x, wt, _t(n, o, oh, ow, seed=2, dtype=dtype)


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


# float32: native/conv_weight_grad_f32_avx2.c

F32_SHAPES = [  # n, c, o, h, w, k, stride, pad
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


@needs_f32_kernel
@pytest.mark.parametrize("n,c,o,h,w,k,stride,pad", F32_SHAPES)
def test_the_weight_gradient_matches_float64_at_least_as_well_as_onednn(n, c, o, h, w, k, stride, pad):
    x, wt, g = _case(n, c, o, h, w, k, stride, pad, torch.float32)
    ours = fused_conv.weight_grad_f32(g, x, wt.shape, stride, pad)
    exact, onednn = _reference(g, x, wt, stride, pad, torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == wt.shape and ours.is_contiguous(memory_format=CL)
    if n == 0:
        assert torch.equal(ours, torch.zeros_like(ours))
        return
    scale = exact.abs().max().item()
    torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-6 * scale)
    # As close as oneDNN, or within float32's rounding of a sum of K terms, sqrt(K)·u·Σ|g x| (oneDNN picks its
    # own kernel from the real CPU, while VITSCOPE_ISA=avx2 on an AVX-512 CPU runs this one beside it).
    terms = n * g.shape[-2] * g.shape[-1]
    magnitude, _ = _reference(g.abs(), x.abs(), wt, stride, pad, torch.float32)
    rounding = (terms ** 0.5 * 2.0 ** -24 * magnitude).max().item()
    err, err_onednn = ((t.double() - exact).abs().max().item() for t in (ours, onednn))
    assert err <= max(err_onednn * 1.5, rounding) + 1e-7 * scale, (err, err_onednn, rounding)


@needs_f32_kernel
def test_one_thread_gives_the_same_sums_as_a_thread_per_core_would_within_rounding():
    x, wt, g = _case(6, 32, 64, 9, 9, 3, 1, 1, torch.float32)
    many = fused_conv.weight_grad_f32(g, x, wt.shape, 1, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = fused_conv.weight_grad_f32(g, x, wt.shape, 1, 1)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, many, rtol=1e-5, atol=1e-5 * many.abs().max().item())


@needs_f32_kernel
@pytest.mark.parametrize("stride", [1, 2])
def test_training_matches_onednn(stride):
    conv = _stem_conv(stride=stride)
    x = torch.randn(6, 32, 10, 9).contiguous(memory_format=CL)
    g = _t(*conv(x).shape, seed=3, dtype=torch.float32)

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


@needs_f32_kernel
@pytest.mark.parametrize("case", ["no_grad", "frozen", "bias", "channels_24", "autocast", "float64", "bfloat16",
                                  "mixed", "same", "uneven_stride", "dilation"])
def test_onednn_keeps_the_conv_where_the_float32_kernel_does_not_apply(case):
    conv, x, autocast = _stem_conv(), _t(2, 32, 8, 8, dtype=torch.float32), False
    if case == "frozen":
        conv.weight.requires_grad_(False)
    elif case == "bias":
        conv = nn.Conv2d(32, 64, 3, 1, 1)
    elif case == "channels_24":
        conv, x = nn.Conv2d(24, 64, 3, 1, 1, bias=False), _t(2, 24, 8, 8, dtype=torch.float32)
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
    assert fused_conv.fusable(_t(2, 32, 8, 8, dtype=torch.float32), _stem_conv())


DTYPES = [pytest.param(BF, marks=needs_kernel, id="bfloat16"),
          pytest.param(torch.float32, marks=needs_f32_kernel, id="float32")]


def _autocast(dtype):
    return torch.autocast("cpu", dtype=BF, enabled=dtype == BF)


def _kernel_name(dtype):
    return "weight_grad" if dtype == BF else "weight_grad_f32"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_conv_stem_takes_its_weight_gradients_from_the_kernel_unless_hooked(dtype, monkeypatch):
    if dtype == BF and "amx_bf16" in native.cpu_features():
        pytest.skip("oneDNN keeps the stem's convs where the CPU has AMX")
    calls = []
    kernel = getattr(fused_conv, _kernel_name(dtype))
    monkeypatch.setattr(fused_conv, _kernel_name(dtype), lambda g, x, *a: calls.append(x.shape[1]) or kernel(g, x, *a))
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick", kernels=True)
    x = torch.randn(4, 1, 28, 28)
    with _autocast(dtype):
        model(x).float().sum().backward()
    ins = [c for c, _ in model.config.stem][:-1]  # each conv's input channels after the first (1 channel)
    assert sorted(calls) == sorted(ins)
    calls.clear()
    model.patch_embed.stem[3].register_forward_hook(lambda m, i, o: None)  # the second conv
    with _autocast(dtype):
        model(x).float().sum().backward()
    assert sorted(calls) == sorted(ins[1:])
    with torch.no_grad(), _autocast(dtype):
        model(x)  # inference: oneDNN's forward alone
    assert sorted(calls) == sorted(ins[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_training_step_of_the_quick_model_gives_onednns_gradients(dtype, monkeypatch):
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick", kernels=True)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    shipped = fused_conv.fusable

    def grads(use_kernel):
        monkeypatch.setattr(fused_conv, "fusable", shipped if use_kernel else (lambda *a: False))
        model.zero_grad()
        with _autocast(dtype):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, ours = grads(True)
    ref_loss, theirs = grads(False)
    assert torch.equal(loss, ref_loss)
    # the stem's weight gradients differ by the order of float32 sums and flow back into the earlier convs'
    # input gradients only through the weights' own values: within bfloat16 noise, or float32's
    tol = 2 ** -7 if dtype == BF else 1e-5
    for name, g in ours.items():
        torch.testing.assert_close(g, theirs[name], rtol=0, atol=tol * theirs[name].abs().max().item(), msg=name)

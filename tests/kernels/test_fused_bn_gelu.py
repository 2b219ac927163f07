"""The conv stem's BatchNorm + GELU in one kernel each way (fused_bn_gelu.py: bfloat16, and float32 on AVX2
CPUs) against float64 and the modules: outputs, gradients, running statistics, eval mode, and where it stands
aside."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitscope.kernels import fused_bn_gelu, fused_gelu, native
from vitscope.models import create_model

BF = torch.bfloat16
CL = torch.channels_last


def _x(shape=(6, 32, 5, 7), seed=0, dtype=BF):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 3 + 1).to(dtype).contiguous(memory_format=CL)


def _bn(c=32, seed=1, **kw):
    torch.manual_seed(seed)
    bn = nn.BatchNorm2d(c, **kw)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
        if bn.running_mean is not None:
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
    return bn


needs_kernel = pytest.mark.skipif(not fused_bn_gelu.fusable(_x(), _bn(), nn.GELU()),
                                  reason=f"vitscope's kernels unavailable: {native.unavailable('avx512_bf16')}")
needs_f32_kernel = pytest.mark.skipif(not fused_bn_gelu.fusable(_x(dtype=torch.float32), _bn(), nn.GELU()),
                                      reason="the float32 kernel runs on CPUs with AVX2 and without AVX-512 "
                                             f"({native.unavailable('avx2') or 'this CPU has AVX-512'})")
DTYPES = [pytest.param(BF, marks=needs_kernel, id="bfloat16"),
          pytest.param(torch.float32, marks=needs_f32_kernel, id="float32")]
# the error allowed against float64 where the modules' own is smaller: bfloat16's rounding, or float32's
FLOOR = {BF: 1e-2, torch.float32: 2e-6}


def _run(fn, x, bn, g):
    """fn's output, and the gradients of x, the weight and the bias for output gradient g."""
    x = x.detach().clone().requires_grad_()
    bn.zero_grad()
    out = fn(x, bn)
    out.backward(g.to(out.dtype))
    return out.detach(), x.grad, bn.weight.grad.clone(), bn.bias.grad.clone()


def _modules(x, bn):
    return F.gelu(bn(x))


@pytest.mark.parametrize("dtype,shape", [pytest.param(BF, (6, 32, 5, 7), marks=needs_kernel, id="bfloat16")]
                         + [pytest.param(torch.float32, s, marks=needs_f32_kernel, id=f"float32-{s[1]}x{s[2]}x{s[3]}")
                            for s in [(6, 32, 5, 7), (3, 8, 4, 4), (2, 128, 7, 7), (40, 16, 3, 3)]])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_training_matches_float64_as_closely_as_the_modules_and_updates_the_running_statistics(momentum, dtype,
                                                                                             shape):
    x, g = _x(shape, dtype=dtype), _x(shape, seed=2, dtype=dtype)
    ours_bn, theirs_bn = _bn(shape[1], momentum=momentum), _bn(shape[1], momentum=momentum)
    ref_bn = copy.deepcopy(theirs_bn).double()
    ours = _run(fused_bn_gelu.bn_gelu, x, ours_bn, g)
    theirs = _run(_modules, x, theirs_bn, g)
    ref = _run(_modules, x.double(), ref_bn, g.double())
    for name, a, b, r in zip(("out", "x", "weight", "bias"), ours, theirs, ref):
        scale = r.abs().max().item()
        err, err_modules = (a.double() - r).abs().max().item() / scale, (b.double() - r).abs().max().item() / scale
        assert a.dtype == b.dtype and a.shape == r.shape and err <= max(2 * err_modules, FLOOR[dtype]), \
            (name, err, err_modules)
    assert ours[0].is_contiguous(memory_format=CL) and ours[1].is_contiguous(memory_format=CL)
    for buf in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(ours_bn, buf), getattr(theirs_bn, buf), rtol=1e-4, atol=1e-5)
    assert ours_bn.num_batches_tracked.item() == theirs_bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_eval_mode_uses_the_running_statistics(dtype):
    x = _x(dtype=dtype)
    bn = _bn().eval()
    with torch.no_grad():
        assert fused_bn_gelu.fusable(x, bn, nn.GELU())
        ours = fused_bn_gelu.bn_gelu(x, bn)
        theirs = F.gelu(bn(x))
        ref = F.gelu(copy.deepcopy(bn).double()(x.double()))
    floor = FLOOR[dtype] * ref.abs().max()
    assert (ours.double() - ref).abs().max() <= max(2 * (theirs.double() - ref).abs().max(), floor)
    assert bn.num_batches_tracked.item() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_without_running_statistics_and_without_gradients(dtype):
    x = _x(dtype=dtype)
    bn = _bn(track_running_stats=False)
    with torch.no_grad():
        ours, theirs = fused_bn_gelu.bn_gelu(x, bn), F.gelu(bn(x))
    assert (ours.float() - theirs.float()).abs().max() <= 2 * FLOOR[dtype] * theirs.float().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_double_backward_raises(dtype):
    x = _x(dtype=dtype).requires_grad_()
    (gx,) = torch.autograd.grad(fused_bn_gelu.bn_gelu(x, _bn()).float().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.float().sum().backward()


@pytest.mark.parametrize("dtype", [BF, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("case", ["float64", "channels_first", "channels_12", "tanh", "relu", "eval_with_grad",
                                  "no_affine", "one_value", "float64_bn"])
def test_the_modules_run_where_the_kernel_does_not_apply(case, dtype):
    x, bn, act = _x(dtype=dtype), _bn(), nn.GELU()
    if case == "float64":
        x = x.double()
    elif case == "channels_first":
        x = x.contiguous()
    elif case == "channels_12":  # neither a multiple of 16 (bfloat16's kernel) nor of 8 (float32's)
        x, bn = _x((6, 12, 5, 7), dtype=dtype), _bn(12)
    elif case == "tanh":
        act = fused_gelu.GELU(approximate="tanh")
    elif case == "relu":
        act = nn.ReLU()
    elif case == "eval_with_grad":
        bn, x = bn.eval(), x.requires_grad_()
    elif case == "no_affine":
        bn = nn.BatchNorm2d(32, affine=False)
    elif case == "float64_bn":
        bn = bn.double()
    else:
        x = _x((1, 32, 1, 1), dtype=dtype)
    assert not fused_bn_gelu.fusable(x, bn, act)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_conv_stem_fuses_each_pair_unless_a_hook_could_see_between(dtype, monkeypatch):
    calls = []
    fused = fused_bn_gelu.bn_gelu
    monkeypatch.setattr(fused_bn_gelu, "bn_gelu", lambda x, bn: calls.append(x.shape[1]) or fused(x, bn))
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick", kernels=True)
    ref_model = copy.deepcopy(model)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    with torch.autocast("cpu", dtype=BF, enabled=dtype == BF):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    assert calls == [c for c, _ in model.config.stem]  # every BatchNorm + GELU of the stem
    if dtype == torch.float32:  # the same step with the modules: float32's rounding apart
        shipped = fused_bn_gelu.fusable
        monkeypatch.setattr(fused_bn_gelu, "fusable", lambda *a: False)
        ref_loss = F.cross_entropy(ref_model(x), y)
        ref_loss.backward()
        monkeypatch.setattr(fused_bn_gelu, "fusable", shipped)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-4 * q.grad.abs().max().item(), msg=name)
        for (name, b), r in zip(model.named_buffers(), ref_model.buffers()):
            torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-6, msg=name)
    calls.clear()
    seen = []
    model.patch_embed.stem[1].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast("cpu", dtype=BF, enabled=dtype == BF):
        model(x)
    assert seen == [dtype] and calls == [c for c, _ in model.config.stem][1:]  # the hooked BatchNorm ran alone

"""oneDNN's fused linear (bias, and in inference GELU, inside the matmul) in bfloat16: when it runs, and
that it gives nn.Linear's and F.gelu's numbers, and in training addmm's gradients, to bfloat16 rounding,
checked against float64. vitscope's own product kernel, which takes these calls on CPUs with AVX512-BF16
and no AMX, is switched off here (`onednn_products`); tests/test_linear_bf16.py tests it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitscope import kernels
from vitscope.kernels import fused_gelu, fused_linear, linear_bf16, native, registry
from vitscope.kernels.fused_linear import Linear
from vitscope.vit import Mlp, VisionTransformer, ViTConfig

pytestmark = pytest.mark.skipif(not fused_linear.available(), reason="no oneDNN bfloat16 linear in this torch/CPU")

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def onednn_products(monkeypatch):
    """The products in oneDNN, as on CPUs where vitscope's kernel does not run."""
    monkeypatch.setattr(linear_bf16, "runnable", lambda *args, **kwargs: False)


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused kernel's calls."""
    seen = []
    kernel = fused_linear._KERNEL

    table = fused_gelu.gelu_

    def counting(*args):
        seen.append(args[3])  # the post-op: "none" or "gelu"
        return kernel(*args)

    def table_pass(y):  # GELU looked up right after the matmul (vitscope's kernels): the call's post-op too
        seen[-1] = "gelu"
        return table(y)

    monkeypatch.setattr(fused_linear, "_KERNEL", counting)
    monkeypatch.setattr(fused_gelu, "gelu_", table_pass)
    return seen


def _layer(i: int = 48, o: int = 80, bias: bool = True, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(i, o, bias=bias)
    with torch.no_grad():
        if bias:
            layer.bias.normal_()  # large enough that a lost or doubled bias shows
    return layer


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gelu", [False, "table", "epilogue"])
@pytest.mark.parametrize("shape", [(37, 48), (3, 50, 48), "transposed"])
def test_fused_linear_is_as_close_to_float64_as_autocast_linear(shape, gelu, bias, calls, monkeypatch):
    """GELU by vitscope's table after the matmul where its kernels run, else in oneDNN's epilogue."""
    if gelu == "epilogue":
        monkeypatch.setattr(native, "runnable", lambda *t, isa: False)
    elif gelu == "table" and not native.has("avx512_bf16"):
        pytest.skip(f"vitscope's GELU table needs its kernels: {native.unavailable('avx512_bf16')}")
    layer = _layer(bias=bias)
    g = torch.Generator().manual_seed(1)
    if shape == "transposed":  # (3, 50, 48) with the last two dims swapped in memory, as after a rearrange
        x = torch.randn(3, 48, 50, generator=g).transpose(1, 2)
    else:
        x = torch.randn(*shape, generator=g)
    ref = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    ref = F.gelu(ref) if gelu else ref
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
        assert fused_linear.fusable(x, layer.weight, layer.bias)
        out = fused_linear.linear(x, layer.weight, layer.bias, gelu=gelu)
        plain = F.linear(x, layer.weight, layer.bias)
        plain = F.gelu(plain) if gelu else plain
    assert calls == ["gelu" if gelu else "none"]
    assert out.dtype == BF16 and out.shape == plain.shape
    # bfloat16 keeps 8 bits: the fused kernel rounds once (after bias and GELU), autocast two or three times
    assert _err(out, ref) < 0.01
    assert _err(out, ref) <= _err(plain, ref) * 1.01


def _grads(layer: nn.Linear, x: torch.Tensor, grad: torch.Tensor, forward) -> list[torch.Tensor]:
    """Gradients of x, weight and bias after `forward(x)` and a backward of `grad`."""
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    forward(x).backward(grad)
    return [x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()]


@pytest.mark.parametrize("shape", [(37, 48), (3, 50, 48), "transposed"])
def test_training_runs_the_kernel_with_addmms_gradients(shape, calls):
    layer = _layer()
    g = torch.Generator().manual_seed(1)
    if shape == "transposed":
        x = torch.randn(3, 48, 50, generator=g).transpose(1, 2)
    else:
        x = torch.randn(*shape, generator=g)
    grad = torch.randn(*x.shape[:-1], 80, generator=g)

    def autocast(f):
        def run(x):
            with torch.autocast("cpu", dtype=BF16):
                return f(x)
        return run

    fused = _grads(layer, x, grad, autocast(layer))
    assert calls == ["none"]  # the forward ran the kernel; the backward is matmuls
    plain = _grads(layer, x, grad, autocast(lambda x: F.linear(x, layer.weight, layer.bias)))
    ref = _grads(layer.double(), x.double(), grad.double(), layer)
    layer.float()
    for name, f, p, r in zip(["x", "weight", "bias"], fused, plain, ref):
        assert f.dtype == p.dtype and f.shape == p.shape == r.shape, name
        assert _err(f, r) < 0.01, name
        assert _err(f, r) <= _err(p, r) * 1.1 + 1e-4, name  # as close to float64 as addmm's backward


def test_training_computes_only_the_gradients_asked_for(calls):
    layer = _layer()
    layer.weight.requires_grad_(False)
    x = torch.randn(5, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16):
        layer(x).float().sum().backward()
    assert calls == ["none"]
    assert layer.weight.grad is None and layer.bias.grad is not None and x.grad is not None
    assert torch.allclose(layer.bias.grad, torch.full((80,), 5.0))
    with torch.autocast("cpu", dtype=BF16):
        layer(torch.randn(5, 48)).float().sum().backward()  # only the bias wants a gradient
    assert calls == ["none", "none"] and torch.allclose(layer.bias.grad, torch.full((80,), 10.0))


def test_double_backward_matches_addmms():
    layer = _layer()
    x = torch.randn(6, 48)

    def second_order(f):
        layer.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16):
            out = f(xr)
        (gx,) = torch.autograd.grad((out.float() ** 2).sum(), xr, create_graph=True)
        (gx.float() ** 2).sum().backward()
        return layer.weight.grad.clone()

    fused = second_order(layer)
    plain = second_order(lambda x: F.linear(x, layer.weight, layer.bias))
    assert (fused - plain).abs().max() <= 0.02 * plain.abs().max()


def test_forward_ad_and_torch_func_keep_f_linear(calls):
    import torch.autograd.forward_ad as fwAD

    layer = _layer()
    x = torch.randn(4, 48)
    with torch.autocast("cpu", dtype=BF16), fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        tangent = fwAD.unpack_dual(layer(dual)).tangent
    assert tangent is not None and calls == []
    with torch.autocast("cpu", dtype=BF16):
        g = torch.func.grad(lambda x: layer(x).float().sum())(x)
    assert calls == [] and torch.allclose(g, layer.weight.sum(0), atol=0.05)


def test_the_gelu_is_fused_only_where_no_gradient_is_needed(calls, monkeypatch):
    from vitscope.kernels import fused_mlp

    monkeypatch.setattr(fused_mlp, "fusable", lambda *a: False)  # training's own MLP: tests/test_fused_mlp.py
    mlp = kernels.apply(Mlp(48, 96))
    x = torch.randn(2, 48)
    with torch.autocast("cpu", dtype=BF16):
        mlp(x).float().sum().backward()
        assert calls == ["none", "none"]  # fc1 and fc2 fused, the GELU on its own (its backward needs fc1's output)
        with pytest.raises(ValueError, match="inference only"):
            fused_linear.linear(x, mlp.fc1.weight, mlp.fc1.bias, gelu=True)
        with torch.no_grad():
            mlp(x)
    assert calls[2:] == ["gelu", "none"]


def test_float32_and_float16_keep_f_linear_exactly(calls):
    layer = _layer()
    x = torch.randn(4, 48)
    with torch.inference_mode():
        if not fused_linear.float32_available():  # on AMD CPUs float32 takes oneDNN's path (test_linear_f32.py)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        with torch.autocast("cpu", dtype=torch.float16):
            assert not fused_linear.fusable(x, layer.weight, layer.bias)
    assert calls == []


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, from setting the flags
def test_oneDNN_switched_off_keeps_f_linear(calls):
    layer = _layer()
    x = torch.randn(4, 48)
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
        with torch.backends.mkldnn.flags(enabled=False):
            assert not fused_linear.fusable(x, layer.weight, layer.bias)
            layer(x)
        assert fused_linear.fusable(x, layer.weight, layer.bias)
    assert calls == []


def test_bfloat16_weights_without_autocast_fuse_and_mixed_dtypes_keep_torchs_error(calls):
    layer = _layer().to(BF16)
    x = torch.randn(4, 48)
    with torch.inference_mode():
        out = layer(x.to(BF16))
        assert calls == ["none"]
        assert (out.float() - F.linear(x.to(BF16), layer.weight, layer.bias).float()).abs().max() < 0.05
        with pytest.raises(RuntimeError):  # float32 input, bfloat16 weights: nn.Linear's own error
            layer(x)


def test_traced_graphs_keep_the_portable_linear():
    layer = _layer().to(BF16).eval()
    with torch.no_grad():
        traced = torch.jit.trace(layer, torch.randn(2, 48, dtype=BF16), check_trace=False)
    assert "aten::linear" in str(traced.graph) and "mkldnn" not in str(traced.graph)


def test_linear_keeps_nn_linears_state_dict_and_hooks():
    plain = nn.Linear(48, 80)
    layer = _layer()
    layer.load_state_dict(plain.state_dict())
    assert isinstance(layer, nn.Linear) and list(layer.state_dict()) == ["weight", "bias"]
    seen = []
    layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
        layer(torch.randn(2, 48))
    assert seen == [BF16]


def test_mlp_fuses_gelu_unless_a_hook_could_see_the_hidden_activation(calls):
    torch.manual_seed(0)
    mlp = kernels.apply(Mlp(48, 96)).eval()
    x = torch.randn(2, 7, 48)
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
        fused = mlp(x)
        assert calls == ["gelu", "none"]  # fc1 + bias + GELU in one kernel, then fc2 + bias
        hidden = []
        handle = mlp.act.register_forward_hook(lambda m, i, o: hidden.append(o.shape))
        hooked = mlp(x)
        handle.remove()
    assert hidden == [(2, 7, 96)] and calls[2:] == ["none", "none"]  # fc1 alone, then fc2: GELU ran as a module
    ref = F.linear(F.gelu(F.linear(x.double(), mlp.fc1.weight.double(), mlp.fc1.bias.double())),
                   mlp.fc2.weight.double(), mlp.fc2.bias.double())
    assert _err(fused, ref) < 0.02 and _err(hooked, ref) < 0.02


def test_mlp_in_training_mode_with_dropout_does_not_fuse(calls):
    mlp = kernels.apply(Mlp(48, 96, drop=0.5)).train()
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        mlp(torch.randn(2, 48))
    assert "gelu" not in calls


def test_vit_bfloat16_inference_logits_match_the_unfused_model(calls, monkeypatch):
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=3, num_heads=4)
    model = kernels.apply(VisionTransformer(cfg)).eval()
    x = torch.randn(8, 1, 28, 28)
    with torch.inference_mode():
        ref = model.double()(x.double())
        model.float()
        with torch.autocast("cpu", dtype=BF16):
            fused = model(x)
            assert calls.count("gelu") == 3  # fc1 of each block
            assert len(calls) == 1 + 3 * 4 + 1  # patch embedding, qkv/proj/fc1/fc2 of each block, head
            monkeypatch.setattr(fused_linear, "available", lambda: False)
            plain = model(x)
    assert _err(fused, ref) < 0.03
    assert _err(fused, ref) <= _err(plain, ref) * 1.25
    assert (fused.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_patch_embedding_runs_as_a_linear_of_flattened_patches(calls):
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=32, patch_size=8, in_chans=3, num_classes=0, embed_dim=48, depth=0, num_heads=4)
    model = kernels.apply(VisionTransformer(cfg)).eval()
    pe = model.patch_embed
    x = torch.randn(2, 3, 32, 32)
    ref = F.conv2d(x.double(), pe.proj.weight.double(), pe.proj.bias.double(), stride=8).flatten(2).transpose(1, 2)
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
        fused = pe(x)
        assert calls == ["none"]
        seen = []
        handle = pe.proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        conv = pe(x)  # a hook on the conv: it runs as the conv
        handle.remove()
    assert seen == [(2, 48, 4, 4)] and calls == ["none"]
    assert fused.shape == conv.shape == (2, 16, 48)
    assert _err(fused, ref) < 0.01 and _err(fused, ref) <= _err(conv, ref) * 1.01


def test_a_conv_stem_keeps_the_patch_conv(calls):
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=28, patch_size=4, in_chans=1, num_classes=0, embed_dim=32, depth=0, num_heads=4,
                    stem=[(16, 2)])
    model = kernels.apply(VisionTransformer(cfg)).eval()
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
        model.patch_embed(torch.randn(2, 1, 28, 28))
    assert calls == []


def test_a_replaced_fc1_runs_its_own_forward(calls):
    ran = []

    class Adapter(nn.Linear):  # a subclass with its own forward, as adapters and LoRA layers have
        def forward(self, x):
            ran.append(x.shape)
            return 2 * super().forward(x)

    torch.manual_seed(0)
    mlp = kernels.apply(Mlp(48, 96)).eval()
    x = torch.randn(2, 48)
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF16):
        mlp(x)
        mlp.fc1 = Adapter(48, 96)
        mlp(x)
    assert calls.count("gelu") == 1 and ran == [(2, 48)]  # fused before the swap, the adapter's forward after


def test_vit_training_gradients_match_the_unfused_model(calls, monkeypatch):
    from vitscope.kernels import fused_mlp

    monkeypatch.setattr(fused_mlp, "fusable", lambda *a: False)  # training's own MLP: tests/test_fused_mlp.py
    torch.manual_seed(0)
    cfg = ViTConfig(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4)
    model = kernels.apply(VisionTransformer(cfg))
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16):
            F.cross_entropy(model(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    fused = grads()
    # the patch embedding, qkv/proj/fc1/fc2 of the first block, qkv/proj of the last (its MLP reads only the
    # class token: the same kernel, fewer rows), the head; no GELU is fused in training
    assert calls == ["none"] * (1 + 4 + 4 + 1)
    monkeypatch.setattr(fused_linear, "available", lambda: False)
    plain = grads()
    assert fused.keys() == plain.keys() and all(g.abs().sum() > 0 for g in fused.values())
    for name in fused:  # addmm also adds the bias to the float32 accumulator: the same numbers, up to sum order
        assert (fused[name] - plain[name]).abs().max() <= 0.002 * plain[name].abs().max(), name


needs_bf16_kernels = pytest.mark.skipif(
    not native.has("avx512_bf16") or "amx_bf16" in native.cpu_features(),
    reason="the weight-gradient kernel runs where vitscope's bfloat16 kernels do and oneDNN has no AMX")


@needs_bf16_kernels
@pytest.mark.parametrize("m", [1, 7, 255, 1000])  # odd rows, less than a chunk, several chunks per thread
@pytest.mark.parametrize("out_in", [(32, 64), (96, 128), (128, 512), (512, 128)])
def test_weight_grad_kernel_rounds_the_float64_product(m, out_in):
    out, inp = out_in
    gen = torch.Generator().manual_seed(m + out)
    g = torch.randn(m, out, generator=gen).to(BF16)
    x = torch.randn(m, inp, generator=gen).to(BF16)
    assert fused_linear._native_weight_grad(g, x)
    ours = fused_linear.weight_grad(g, x)
    ref = g.double().t() @ x.double()
    assert ours.dtype == BF16 and ours.shape == (out, inp)
    # float32 sums rounded once to bfloat16: within half a bfloat16 ulp of the exact product, and a hair
    assert ((ours.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5 * m).all()
    onednn = g.t() @ x  # oneDNN's: the same rounding
    assert _err(ours, ref) <= _err(onednn, ref) * 1.01 + 1e-6
    dw, db = fused_linear.weight_and_bias_grad(g, x, bias=True)  # the bias gradient from the same chunks
    assert torch.equal(dw, ours) and db.dtype == BF16 and db.shape == (out,)
    exact = g.double().sum(0)
    assert ((db.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5 * m).all()
    assert fused_linear.weight_and_bias_grad(g, x, bias=False)[1] is None


@needs_bf16_kernels
def test_weight_grad_kernel_reads_strided_rows_and_leaves_other_shapes_to_onednn(monkeypatch):
    wide = torch.randn(300, 3 * 64).to(BF16)
    g, x = wide[:, 64:128], torch.randn(300, 64).to(BF16)  # g's rows 192 apart, like a slice of a fused output
    assert fused_linear._native_weight_grad(g, x)
    torch.testing.assert_close(fused_linear.weight_grad(g, x).double(), g.double().t() @ x.double(),
                               atol=0.0, rtol=2 ** -8)
    for a, b in [(torch.randn(64, 48), torch.randn(64, 64)),      # out not a multiple of 32
                 (torch.randn(64, 32), torch.randn(64, 96)),      # in not a multiple of 64
                 (torch.randn(64, 512), torch.randn(64, 256))]:   # out·in past the kernel's cache-sized sums
        a, b = a.to(BF16), b.to(BF16)
        assert not fused_linear._native_weight_grad(a, b)
        assert torch.equal(fused_linear.weight_grad(a, b), a.t() @ b)
        dw, db = fused_linear.weight_and_bias_grad(a, b, bias=True)
        assert torch.equal(dw, a.t() @ b) and torch.equal(db, a.sum(0))
    assert not fused_linear._native_weight_grad(torch.randn(64, 32), torch.randn(64, 64))  # float32
    assert not fused_linear._native_weight_grad(g.t(), x.t())
    monkeypatch.setattr(registry, "_decided", None)  # decided again with the CPU below; the test's end restores it
    monkeypatch.setattr(native, "cpu_has_amx", lambda: True)
    assert not fused_linear._native_weight_grad(g, x)  # oneDNN's AMX tiles instead
    monkeypatch.undo()
    monkeypatch.setattr(native, "runnable", lambda *t, isa: False)
    assert not fused_linear._native_weight_grad(g, x)

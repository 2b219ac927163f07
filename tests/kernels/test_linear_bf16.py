"""vitscope/kernels/linear_bf16.py (native/linear.c): a linear layer's bfloat16 products, forward (with the bias, and
with GELU and its derivative looked up in the same pass) and its input gradient (with the multiply by GELU's
derivative), against float64 and against oneDNN's linear and torch's matmul (the references we did not
write); and where the model's layers call it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitscope.kernels import fused_gelu, fused_linear, linear_bf16, native, registry
from vitscope.models import create_model

BF = torch.bfloat16

needs_kernel = pytest.mark.skipif(registry.runs("linear product", BF) is None,
                                  reason="vitscope's linear kernel runs with AVX512-BF16 and without AMX: "
                                         f"{registry.why_none('linear product', BF)}")


def _t(*shape, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(BF)


def _close_as_onednn(ours: torch.Tensor, exact: torch.Tensor, onednn: torch.Tensor) -> None:
    """float32 sums rounded once to bfloat16: within half a bfloat16 step of the exact value (a little more
    for the float32 sums' own rounding), and never much further from it than oneDNN's result."""
    assert ours.dtype == BF and ours.shape == exact.shape
    torch.testing.assert_close(ours.double(), exact, rtol=2 ** -8, atol=1e-5 * exact.abs().max().item())
    assert (ours.double() - exact).abs().max() <= (onednn.double() - exact).abs().max() * 1.01 + 1e-12


SHAPES = [  # m, k (the reduction), n (the output's columns)
    (12800 // 64, 128, 384),  # the plain 28x28 ViT's qkv, fewer rows
    (97, 128, 512),           # fc1's shape; rows not a multiple of the 4-row block or the 96-row chunk
    (3, 48, 80),              # fewer rows than a block, a partial last 16-column vector
    (50, 16, 128),            # the patch embedding: a short reduction
    (7, 16, 10),              # the head: fewer columns than a vector
    (33, 1536, 384),          # ViT-S/16's fc2: a long reduction into wide rows
    (20, 130, 100),           # k not a multiple of 32, n not of 16
]


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_forward_is_the_float64_product_rounded_once(m, k, n, bias):
    x, w = _t(m, k), _t(n, k, seed=1)
    b = _t(n, seed=2, scale=3.0) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    ours = linear_bf16.forward(x, w, b)
    _close_as_onednn(ours, exact, F.linear(x, w, b))


@needs_kernel
@pytest.mark.parametrize("gelu", [False, True], ids=["", "gelu"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_a_weight_packed_once_gives_the_same_bits(m, k, n, gelu):
    x, w, b = _t(m, k), _t(n, k, seed=1), _t(n, seed=2, scale=3.0)
    packed = linear_bf16.pack(w[:, :])
    assert torch.equal(linear_bf16.forward(x, w, b, gelu=gelu, packed=packed), linear_bf16.forward(x, w, b, gelu=gelu))
    assert torch.equal(linear_bf16.forward(x, w, b.float(), packed=packed), linear_bf16.forward(x, w, b))


@needs_kernel
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_input_gradient_is_the_float64_product_rounded_once(m, k, n):
    # g (m, n) W with W (n, k): the reduction runs over the layer's outputs
    g, w = _t(m, n), _t(n, k, seed=1)
    if n % 2:
        pytest.skip("the input gradient's reduction (the layer's outputs) must be even")
    ours = linear_bf16.input_grad(g, w)
    _close_as_onednn(ours, g.double() @ w.double(), g @ w)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(97, 128, 512), (64, 512, 384), (5, 130, 40)])
def test_input_gradient_times_gelus_derivative_rounds_once(m, k, n):
    """fc2's backward: (g W2) ∘ d rounded once, as oneDNN's matmul with a multiply in its epilogue."""
    g, w, d = _t(m, n), _t(n, k, seed=1), _t(m, k, seed=2)
    ours = linear_bf16.input_grad(g, w, mul=d)
    exact = (g.double() @ w.double()) * d.double()
    onednn = torch.ops.mkldnn._linear_pointwise.binary(g, d, w.t(), None, "mul")
    _close_as_onednn(ours, exact, onednn)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(97, 128, 512), (3, 48, 80), (20, 130, 100)])
def test_gelu_in_the_same_pass_is_the_tables(m, k, n):
    """GELU and its derivative looked up from the rounded sums: the same bits as the table's own pass over
    the kernel's plain output, and close to float64's GELU of the exact product."""
    x, w, b = _t(m, k), _t(n, k, seed=1), _t(n, seed=2)
    a = linear_bf16.forward(x, w, b)
    h, d = linear_bf16.forward_gelu(x, w, b)
    h_table, d_table = fused_gelu.gelu_and_derivative(a)
    assert torch.equal(h, h_table) and torch.equal(d, d_table)
    assert torch.equal(linear_bf16.forward(x, w, b, gelu=True), h)
    exact = F.gelu(F.linear(x.double(), w.double(), b.double()))
    torch.testing.assert_close(h.double(), exact, rtol=2 ** -7, atol=2 ** -7 * exact.abs().max().item())


@needs_kernel
def test_strided_rows_and_nonfinite_values():
    """Rows at a stride (a slice of a wider tensor) are read in place; a NaN or infinity in a row gives
    NaN or infinity in that row only, as the float64 product does."""
    wide, w = _t(40, 200), _t(64, 128, seed=1)
    x = wide[:, 10:138]  # (40, 128), row stride 200
    assert x.stride() == (200, 1)
    x[3, 5] = float("nan")
    x[7, 0] = float("inf")
    ours = linear_bf16.forward(x, w)
    exact = F.linear(x.double(), w.double())
    assert torch.isnan(ours[3]).all() and not torch.isfinite(ours[7]).any()
    finite = [i for i in range(40) if i not in (3, 7)]
    _close_as_onednn(ours[finite], exact[finite], F.linear(x.contiguous(), w)[finite])


def test_runnable_takes_only_what_the_kernel_handles(monkeypatch):
    x, w = _t(8, 128), _t(64, 128)
    if not native.has("avx512_bf16"):
        assert not linear_bf16.runnable(x, w)
        return
    monkeypatch.setattr(registry, "_decided", None)  # decided again with the CPU below; the test's end restores it
    monkeypatch.setattr(native, "cpu_has_amx", lambda: False)
    assert linear_bf16.runnable(x, w, _t(64))
    assert linear_bf16.runnable(_t(8, 64), w, forward=False)       # the input gradient: k = out
    assert not linear_bf16.runnable(x.float(), w)                  # bfloat16 only
    assert not linear_bf16.runnable(_t(8, 127), _t(64, 127))       # an odd reduction
    assert not linear_bf16.runnable(_t(128, 8).t(), w)             # columns not at unit stride
    assert not linear_bf16.runnable(_t(0, 128), w)                 # no rows
    assert linear_bf16.runnable(_t(8, 1536), _t(384, 1536))        # ViT-S/16's fc2
    assert not linear_bf16.runnable(_t(8, 8192), _t(64, 8192))     # longer than MAX_K
    # sizes that do not match go to oneDNN, whose error names them
    assert not linear_bf16.runnable(_t(8, 96), w)
    assert not linear_bf16.runnable(x, w, forward=False)
    assert not linear_bf16.runnable(x, w, _t(63))
    monkeypatch.setattr(native, "cpu_has_amx", lambda: True)
    registry.decide()
    assert not linear_bf16.runnable(x, w)                          # oneDNN's AMX tiles are faster


def test_a_mismatched_input_keeps_torchs_error():
    """A Linear given the wrong width fails as nn.Linear does, never reading past the weight."""
    layer = fused_linear.Linear(128, 64)
    with torch.autocast("cpu", dtype=BF), pytest.raises(RuntimeError):
        layer(torch.randn(8, 96))


def _train_grads(model, x, y, use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setattr(linear_bf16, "runnable", lambda *a, **k: False)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    monkeypatch.undo()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@needs_kernel
def test_a_vit_training_step_calls_it_and_gets_onednns_gradients(monkeypatch):
    """The plain 28x28 ViT's bfloat16 step: its linear layers' forwards, fc1's GELU, the input gradients and
    fc2's multiply by GELU's derivative run the kernel, and loss and gradients agree with the same step in
    oneDNN's products to bfloat16 rounding."""
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=2, mlp_ratio=4.0, kernels=True)
    x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
    seen = []
    real = linear_bf16._call

    def counting(x_, k, w, weight_rows, n, bias, mul, gelu=False, derivative=False, packed=None):
        seen.append(("forward" if weight_rows else "input grad", k, n, mul is not None, gelu, derivative))
        return real(x_, k, w, weight_rows, n, bias, mul, gelu, derivative, packed)

    monkeypatch.setattr(linear_bf16, "_call", counting)
    loss, grads = _train_grads(model, x, y, True, monkeypatch)
    assert ("forward", 128, 384, False, False, False) in seen          # qkv
    assert ("forward", 128, 512, False, True, True) in seen            # fc1 with gelu and gelu'
    assert ("input grad", 128, 512, True, False, False) in seen        # fc2's backward times gelu'
    assert ("input grad", 384, 128, False, False, False) in seen       # qkv's: a reduction over 384
    assert ("forward", 512, 128, False, False, False) in seen          # fc2
    ref_loss, ref_grads = _train_grads(model, x, y, False, monkeypatch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for name, g in grads.items():
        ref = ref_grads[name]
        scale = ref.abs().max().item()
        assert (g - ref).abs().max().item() <= 0.05 * scale + 1e-6, name


@needs_kernel
def test_vit_s_inference_logits_agree_with_onednns(monkeypatch):
    """Inference with fc1's GELU in the kernel's pass: the same logits as with oneDNN's products, to
    bfloat16 rounding (a narrow ViT-S/16 shape to keep the test fast)."""
    torch.manual_seed(0)
    model = create_model("vit_small_patch16_224", depth=2, img_size=64, kernels=True).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF):
        ours = model(x).float()
        monkeypatch.setattr(linear_bf16, "runnable", lambda *a, **k: False)
        ref = model(x).float()
    assert (ours - ref).abs().max().item() <= 0.03 * ref.abs().max().item()

"""vitscope's bfloat16 attention kernels (short sequences), each build this CPU runs (AMX, AVX512-BF16),
against float64 and PyTorch's kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_close, long_vit_grads_against_pytorch, qkv_attention_against_float64
from vitscope import kernels
from vitscope.attention import attend
from vitscope.kernels import native, registry, short_attention
from vitscope.models import create_model

BF = torch.bfloat16


BUILDS = [k for k in registry.KERNELS if k.name == "attention" and "bfloat16" in k.dtypes]


@pytest.fixture(autouse=True, params=BUILDS, ids=lambda k: k.isa)
def build(request, monkeypatch):
    """Every test runs once per bfloat16 build, that build alone in the registry, where this CPU runs it."""
    kernel = request.param
    if not native.has(kernel.isa):
        pytest.skip(f"{kernel.isa} kernel unavailable: {native.unavailable(kernel.isa)}")
    monkeypatch.setattr(registry, "KERNELS", tuple(k for k in registry.KERNELS if k in (kernel,) or k not in BUILDS))
    assert registry.runs("attention", BF) == kernel
    return kernel


def _qkv(b, h, nq, nk, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, nq, d, generator=gen) * 1.5).to(BF)
    k = (torch.randn(b, h, nk, d, generator=gen) * 1.5).to(BF)
    v = torch.randn(b, h, nk, d, generator=gen).to(BF)
    return q, k, v


def _err(out, q, k, v, scale=None):
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)
    return (out.double() - ref).abs().max().item()


@pytest.mark.parametrize("nq,nk,d", [(50, 50, 32), (197, 197, 64), (1, 50, 32), (1, 1, 32), (15, 16, 32),
                                     (16, 17, 64), (33, 31, 96), (64, 256, 128), (100, 255, 32), (17, 33, 64),
                                     (300, 40, 32), (529, 256, 64)])
def test_matches_float64_as_closely_as_pytorch(nq, nk, d):
    q, k, v = _qkv(2, 3, nq, nk, d)
    with torch.inference_mode():
        ours = short_attention.attend(q, k, v)
        theirs = F.scaled_dot_product_attention(q, k, v)
    assert ours.shape == theirs.shape == (2, 3, nq, d)
    # Both round the output to bfloat16 once: the kernel's error is that rounding, like PyTorch's.
    assert _err(ours, q, k, v) <= 1.25 * _err(theirs, q, k, v) + 1e-3
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("nq,nk,d", [(50, 50, 32), (17, 1, 64), (33, 200, 32), (40, 700, 64)])
def test_log_sum_exp_kept_for_the_backward_matches_float64(nq, nk, d):
    """The forward keeps each query's log2-sum-exp2 of its scaled scores, from which the backward
    recomputes the weights: vector log2 over a block's rows, within float32's rounding."""
    q, k, v = _qkv(2, 3, nq, nk, d, seed=nq)
    q = q * torch.linspace(0.1, 4, nq).view(1, 1, nq, 1).to(BF)  # sums from about nk down to about 1
    lse = torch.empty(2, 3, nq)
    scale = d**-0.5
    short_attention._forward(q, k, v, scale, lse)
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale
    ref = torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    torch.testing.assert_close(lse.double(), ref, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("nq,nk,d", [(300, 300, 32), (50, 257, 64), (1, 700, 32), (17, 600, 128), (300, 513, 96),
                                     (257, 1025, 64)])
def test_many_keys_without_gradients_match_float64_as_closely_as_pytorch(nq, nk, d):
    """Past 256 keys the forward carries an online softmax from key block to key block."""
    q, k, v = _qkv(1, 2, nq, nk, d, seed=nk)
    with torch.inference_mode():
        ours = short_attention.attend(q, k, v)
        theirs = F.scaled_dot_product_attention(q, k, v)
    assert _err(ours, q, k, v) <= 1.25 * _err(theirs, q, k, v) + 1e-3
    torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2)


def test_many_keys_where_the_largest_score_comes_late():
    """Each key block raises the running maximum by far more than exp2 spans: what was summed
    before must be rescaled to nothing, not overflow or stay."""
    q, k, v = _qkv(1, 1, 40, 900, 32, seed=5)
    ramp = torch.linspace(1, 60, 900).view(1, 1, 900, 1)
    k = (k.float() * ramp).to(BF)  # later keys score ever higher
    with torch.inference_mode():
        out = short_attention.attend(q, k, v)
    assert torch.isfinite(out).all()
    ref_err = _err(F.scaled_dot_product_attention(q, k, v), q, k, v)
    assert _err(out, q, k, v) <= 1.25 * ref_err + 1e-2


def test_strided_views_of_qkv_and_scale():
    b, n, h, d = 4, 50, 4, 32
    qkv = torch.randn(b, n, 3, h, d, generator=torch.Generator().manual_seed(1)).to(BF)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # non-contiguous (B, H, N, D), as the model splits
    with torch.inference_mode():
        out = short_attention.attend(q, k, v, scale=0.3)
    assert _err(out, q, k, v, scale=0.3) <= 1.25 * _err(F.scaled_dot_product_attention(q, k, v, scale=0.3),
                                                        q, k, v, scale=0.3) + 1e-3
    assert out.transpose(1, 2).is_contiguous()  # written in the (B, N, H, D) layout the projection reads


def test_large_scores_and_one_hot_softmax():
    q, k, v = _qkv(1, 2, 20, 40, 32)
    q = q * 40  # scores in the thousands: the softmax is one-hot, as exp must not overflow
    with torch.inference_mode():
        out = short_attention.attend(q, k, v)
    assert torch.isfinite(out).all()
    assert _err(out, q, k, v) < 2e-2


def test_attend_routes_only_what_the_kernel_computes_exactly():
    q, k, v = _qkv(2, 2, 50, 50, 32)
    with torch.inference_mode():
        assert short_attention.usable(q, k, v)
        # Routed to this build: kernels.attend gives the kernel's own numbers, not PyTorch's, and those
        # are as close to float64 as PyTorch's (no internal layout asserted: it differs between builds).
        routed = kernels.attend(q, k, v)
        torch.testing.assert_close(routed, short_attention.attend(q, k, v), rtol=0, atol=0)
        assert _err(routed, q, k, v) <= 1.25 * _err(F.scaled_dot_product_attention(q, k, v), q, k, v) + 1e-3
        with kernels.disabled():
            torch.testing.assert_close(kernels.attend(q, k, v), attend(q, k, v), rtol=0, atol=0)
    assert not short_attention.usable(q.half(), k.half(), v.half())
    assert not short_attention.usable(q.float(), k, v)  # one dtype for all three
    many_keys = _qkv(1, 1, 8, 257, 32)
    assert short_attention.usable(*many_keys)  # any number of keys, forward
    assert short_attention.usable(many_keys[0].requires_grad_(), *many_keys[1:])  # and backward
    assert not short_attention.usable(*_qkv(1, 1, 8, 8, 48))  # head dim not a multiple of 32
    qg = q.clone().requires_grad_()
    assert short_attention.usable(qg, k, v)  # training too, with the kernel's backward
    long_q = _qkv(1, 1, 300, 8, 32)[0].requires_grad_()
    assert short_attention.usable(long_q, *_qkv(1, 1, 8, 8, 32)[1:])  # and any number of queries
    with torch.no_grad():
        assert short_attention.usable(long_q, *_qkv(1, 1, 8, 8, 32)[1:])
        mask = torch.rand(2, 1, 50, 50) > 0.3
        masked = attend(q, k, v, mask=mask)  # masks and causal keep PyTorch's kernel
        torch.testing.assert_close(masked, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        torch.testing.assert_close(attend(q, k, v, causal=True),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_vit_inference_matches_pytorch_kernel():
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, kernels=True).eval()
    x = torch.randn(8, 1, 28, 28)
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF):
        ours = model(x).float()
        usable = short_attention.usable
        short_attention.usable = lambda *a: False
        try:
            theirs = model(x).float()
        finally:
            short_attention.usable = usable
    with torch.inference_mode():
        ref = model.double()(x.double()).float()
    assert (ours - ref).abs().max() <= 1.5 * (theirs - ref).abs().max() + 1e-2


def _grads(fn, q, k, v, g):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


def _explicit_bf16(q, k, v):  # attend's training path without the kernels
    w = torch.softmax((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1, dtype=q.dtype)
    return w @ v


@pytest.mark.parametrize("nq,nk,d", [(50, 50, 32), (197, 197, 64), (1, 50, 32), (17, 33, 64), (40, 7, 96),
                                     (256, 256, 128), (16, 16, 32),
                                     # past 256 queries or keys: the blockwise backward
                                     (300, 300, 32), (50, 700, 64), (600, 40, 32), (257, 513, 64), (1, 300, 32)])
def test_gradients_match_float64_better_than_the_explicit_path(nq, nk, d):
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(2, 3, nq, nk, d, seed=3)
    g = torch.randn(2, 3, nq, d, generator=gen).to(BF)
    ref = _grads(torch.nn.functional.scaled_dot_product_attention, q.double(), k.double(), v.double(), g.double())
    ours = _grads(short_attention.attend, q, k, v, g)
    explicit = _grads(_explicit_bf16, q, k, v, g)
    for name, a, e, r in zip(("out", "dq", "dk", "dv"), ours, explicit, ref):
        scale = r.abs().max().item()
        assert a.dtype == BF and a.shape == r.shape, name
        err, err_explicit = (a.double() - r).abs().max().item() / scale, (e.double() - r).abs().max().item() / scale
        assert err <= max(err_explicit, 8e-3), (name, err, err_explicit)


def test_gradients_through_qkv_views_and_a_strided_output_gradient():
    b, n, h, d = 3, 50, 4, 32
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(b, n, 3 * h * d, generator=gen).to(BF)
    g = torch.randn(b, n, h * d * 2, generator=gen).to(BF)[..., ::2]  # a non-contiguous gradient

    def model(qkv_, use):
        q, k, v = qkv_.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        out = short_attention.attend(q, k, v) if use else _explicit_bf16(q.double(), k.double(), v.double())
        return out.transpose(1, 2).reshape(b, n, h * d)

    x = qkv.clone().requires_grad_()
    model(x, True).backward(g)
    ref = qkv.double().requires_grad_()
    model(ref, False).backward(g.double())
    assert (x.grad.double() - ref.grad).abs().max() / ref.grad.abs().max() < 8e-3


@pytest.mark.parametrize("queries,n", [(None, 50), (1, 50), (7, 50), (None, 300), (7, 300)])
def test_attend_qkv_matches_the_split_path(queries, n):
    """n = 300: the blockwise backward, taking rowsum(g o) from the output the forward saved."""
    out, grad, ref, ref_grad = qkv_attention_against_float64(BF, queries, n=n)
    assert (out.double() - ref).abs().max() < 2e-2
    assert (grad.double() - ref_grad).abs().max() / ref_grad.abs().max() < 8e-3


def test_multi_head_attention_takes_the_qkv_path_only_when_nothing_else_is_asked(monkeypatch):
    from vitscope.attention import MultiHeadAttention

    calls = []
    real = short_attention.attend_qkv
    monkeypatch.setattr(short_attention, "attend_qkv", lambda *a, **k: calls.append(1) or real(*a, **k))
    attn = kernels.apply(MultiHeadAttention(128, 4)).to(BF)
    x = torch.randn(2, 50, 128).to(BF)
    with torch.no_grad():
        fast = attn(x)
        assert calls == [1]
        out, weights = attn(x, return_weights=True)  # weights: the explicit path
        assert calls == [1] and weights.shape == (2, 4, 50, 50)
        torch.testing.assert_close(fast, out, atol=2e-2, rtol=2e-2)
        attn(x, mask=torch.ones(2, 1, 1, 50, dtype=torch.bool))
        attn(x, causal=True)
        assert calls == [1]


def test_double_backward_says_it_is_not_supported():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 8, 8, 32))
    out = short_attention.attend(q, k, v)
    (gq,) = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gq.float().sum().backward()


def test_vit_training_gradients_match_the_explicit_path(vit_bf16_grads):
    assert_grads_close(vit_bf16_grads(), vit_bf16_grads(off=(short_attention, "usable")), 5e-2)


def test_long_sequence_vit_training_gradients_match_pytorch(monkeypatch):
    long_vit_grads_against_pytorch(monkeypatch, torch.bfloat16, 5e-2)

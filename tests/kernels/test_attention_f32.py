"""vitscope's float32 attention kernel (the AVX-512 build, short sequences; else the AVX2 one, any length,
blockwise past 256 keys or queries; whichever runs here) against float64, PyTorch's kernels and
torch.nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_close, long_vit_grads_against_pytorch, qkv_attention_against_float64
from vitscope import kernels
from vitscope.attention import MultiHeadAttention, attend
from vitscope.kernels import registry, short_attention
from vitscope.models import create_model

_CHOSEN = short_attention.build_for(torch.float32)  # (instruction set, build), as the registry decided
KERNEL = None if _CHOSEN is None else _CHOSEN[1]
needs_kernel = pytest.mark.skipif(KERNEL is None,
                                  reason=f"kernel unavailable: {registry.why_none('attention', torch.float32)}")
SHAPES = [(50, 50, 32), (197, 197, 64), (1, 50, 32), (1, 1, 16), (15, 16, 32), (16, 17, 64), (33, 31, 96),
          (64, 256, 128), (100, 255, 48), (256, 256, 16)]
if KERNEL is not None and KERNEL.head_dim_multiple == 8:  # the AVX2 build's narrower vectors take these too
    SHAPES += [(50, 50, 8), (9, 23, 24), (197, 197, 40), (31, 130, 72)]
ANY_LENGTH = KERNEL is not None and KERNEL.any_length
needs_any_length = pytest.mark.skipif(not ANY_LENGTH, reason="this CPU's float32 kernel takes at most 256 keys")
# Past 256 keys the forward carries an online softmax over key blocks; past 256 queries or keys the backward
# runs blockwise (key blocks by query chunks), taking rowsum(g o) from the output.
LONG_FORWARD = [(300, 300, 32), (50, 257, 64), (1, 700, 32), (17, 600, 128), (300, 513, 96), (257, 1025, 64),
                (250, 300, 24), (481, 700, 40)]  # chunks of 240 queries; head dims of an odd number of vectors
LONG_BACKWARD = [(300, 300, 32), (50, 700, 64), (600, 40, 32), (257, 513, 64), (1, 300, 32), (513, 600, 8)]


def _qkv(b, h, nq, nk, d, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=gen, dtype=torch.float64) * 1.5
    k = torch.randn(b, h, nk, d, generator=gen, dtype=torch.float64) * 1.5
    v = torch.randn(b, h, nk, d, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _grads(fn, q, k, v, g):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


@needs_kernel
@pytest.mark.parametrize("nq,nk,d", [*SHAPES, (300, 40, 32), (529, 256, 64),
                                     *(pytest.param(*s, marks=needs_any_length) for s in LONG_FORWARD)])
def test_forward_matches_float64_as_closely_as_pytorch(nq, nk, d):
    q, k, v = _qkv(2, 3, nq, nk, d)
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)))
    with torch.inference_mode():
        ours = short_attention.attend(q, k, v)
        theirs = F.scaled_dot_product_attention(q, k, v)
    assert ours.shape == theirs.shape == (2, 3, nq, d) and ours.dtype == torch.float32
    err, err_theirs = ((x.double() - ref).abs().max().item() for x in (ours, theirs))
    assert err <= 2 * err_theirs + 1e-6, (err, err_theirs)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("nq,nk,d", [*SHAPES, *(pytest.param(*s, marks=needs_any_length) for s in LONG_BACKWARD)])
def test_gradients_match_float64_as_closely_as_pytorch(nq, nk, d):
    q, k, v = _qkv(2, 3, nq, nk, d, seed=3)
    g = torch.randn(2, 3, nq, d, generator=torch.Generator().manual_seed(4))
    ref = _grads(F.scaled_dot_product_attention, q.double(), k.double(), v.double(), g.double())
    ours = _grads(short_attention.attend, q, k, v, g)
    theirs = _grads(F.scaled_dot_product_attention, q, k, v, g)
    for name, a, t, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        scale = max(r.abs().max().item(), 1.0)  # with one key dq and dk are 0: compare roundoff absolutely
        err, err_theirs = (a.double() - r).abs().max().item() / scale, (t.double() - r).abs().max().item() / scale
        assert a.dtype == torch.float32 and a.shape == r.shape, name
        assert err <= 2 * err_theirs + 1e-6, (name, err, err_theirs)


@needs_kernel
@pytest.mark.parametrize("nq,nk,d", [(50, 50, 32), (17, 1, 64), (40, 200, 16),
                                     pytest.param(40, 600, 32, marks=needs_any_length)])
def test_log_sum_exp_kept_for_the_backward_matches_float64(nq, nk, d):
    q, k, v = _qkv(2, 3, nq, nk, d, seed=nq)
    q = q * torch.linspace(0.1, 4, nq).view(1, 1, nq, 1)  # sums from about nk down to about 1
    lse = torch.empty(2, 3, nq)
    short_attention._forward(q, k, v, d**-0.5, lse)
    scores = (q.double() @ k.double().transpose(-2, -1)) * d**-0.5
    ref = torch.logsumexp(scores, -1) / torch.log(torch.tensor(2.0, dtype=torch.float64))
    torch.testing.assert_close(lse.double(), ref, atol=2e-6, rtol=1e-6)


@needs_kernel
def test_large_scores_give_a_one_hot_softmax():
    q, k, v = _qkv(1, 2, 20, 40, 32)
    q = q * 100  # scores in the thousands: exp must neither overflow nor go subnormal
    with torch.inference_mode():
        out = short_attention.attend(q, k, v)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@needs_any_length
def test_many_keys_where_the_largest_score_comes_late():
    """Each key block raises the running maximum by far more than exp2 spans: what was summed before must
    be rescaled to nothing, not overflow or stay."""
    q, k, v = _qkv(1, 1, 40, 900, 32, seed=5)
    k = k * torch.linspace(1, 60, 900).view(1, 1, 900, 1)  # later keys score ever higher
    with torch.inference_mode():
        out = short_attention.attend(q, k, v)
        theirs = F.scaled_dot_product_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert torch.isfinite(out).all()
    err, err_theirs = ((x.double() - ref).abs().max().item() for x in (out, theirs))  # scores in the hundreds
    assert err <= 2 * err_theirs + 1e-6, (err, err_theirs)


@needs_kernel
def test_attend_routes_only_what_the_kernel_computes():
    q, k, v = _qkv(2, 2, 50, 50, 32)
    assert short_attention.usable(q, k, v)
    with torch.inference_mode():
        # routed to the kernel: its own numbers (not an internal layout, which a build may change)
        torch.testing.assert_close(kernels.attend(q, k, v), short_attention.attend(q, k, v), rtol=0, atol=0)
    assert short_attention.usable(*_qkv(1, 1, 8, 8, 48))  # multiples of 16, not only of 32
    multiple = KERNEL.head_dim_multiple  # 16 with AVX-512, 8 with AVX2
    assert short_attention.usable(*_qkv(1, 1, 8, 8, 40)) == (40 % multiple == 0)
    assert not short_attention.usable(*_qkv(1, 1, 8, 8, 36))
    # past 256 keys, and 256 queries with gradients: the AVX2 build's blockwise heads, else PyTorch's kernels
    assert short_attention.usable(*_qkv(1, 1, 8, 257, 32)) == ANY_LENGTH
    assert not short_attention.usable(*_qkv(1, 1, 8, 8, 32, dtype=torch.float64))
    long_q = _qkv(1, 1, 300, 8, 32)[0].requires_grad_()
    assert short_attention.usable(long_q, *_qkv(1, 1, 8, 8, 32)[1:]) == ANY_LENGTH
    if ANY_LENGTH:  # past 768 keys only the training pass: PyTorch's kernel infers faster there
        many = _qkv(1, 1, 8, short_attention.AVX2_FLOAT32_INFERENCE_MAX_KEYS + 1, 32)
        assert not short_attention.usable(*many)
        assert short_attention.usable(many[0].requires_grad_(), *many[1:])
    with torch.no_grad():
        assert short_attention.usable(long_q, *_qkv(1, 1, 8, 8, 32)[1:])
        mask = torch.rand(2, 1, 50, 50) > 0.3
        sdpa = F.scaled_dot_product_attention
        torch.testing.assert_close(attend(q, k, v, mask=mask), sdpa(q, k, v, attn_mask=mask))
        torch.testing.assert_close(attend(q, k, v, causal=True), sdpa(q, k, v, is_causal=True))


@needs_kernel
@pytest.mark.parametrize("queries,n", [(None, 50), (1, 50), (7, 50), pytest.param(None, 300, marks=needs_any_length),
                                       pytest.param(7, 300, marks=needs_any_length)])
def test_attend_qkv_matches_float64_through_the_split(queries, n):
    """n = 300: the blockwise backward, taking rowsum(g o) from the output the forward saved."""
    out, grad, ref, ref_grad = qkv_attention_against_float64(torch.float32, queries, g_stride=2, n=n)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("nq,nk,d", [(33, 196, 32), (1, 50, 16), (64, 7, 64),
                                     pytest.param(300, 513, 64, marks=needs_any_length)])
def test_cross_attention_from_the_projections_matches_float64_and_the_split_path(nq, nk, d):
    """attend_q_kv reads q (B, Nq, H·D) and kv (B, M, 2·H·D) in place and writes their gradients in those layouts:
    float64's numbers to float32 rounding, and bit for bit those of `attend` on the split views, which runs the same
    kernel over the same memory and leaves autograd to gather the gradients (300 x 513: blockwise)."""
    b, h = 2, 3
    gen = torch.Generator().manual_seed(5)
    q64 = torch.randn(b, nq, h * d, generator=gen, dtype=torch.float64)
    kv64 = torch.randn(b, nk, 2 * h * d, generator=gen, dtype=torch.float64) * 1.5
    g64 = torch.randn(b, nq, h * d, generator=gen, dtype=torch.float64)
    scale = d**-0.5

    def split(attention):
        def fn(q, kv):
            out = attention(*short_attention.split_q_kv(q, kv, h), scale=scale)  # (B, H, Nq, D)
            return out.transpose(1, 2).reshape(b, nq, h * d)
        return fn

    def run(fn, dtype):
        q, kv = (t.to(dtype).detach().requires_grad_() for t in (q64, kv64))
        out = fn(q, kv)
        out.backward(g64.to(dtype))
        return out.detach(), q.grad, kv.grad

    ours = run(lambda q, kv: short_attention.attend_q_kv(q, kv, h, scale), torch.float32)
    for a, b_ in zip(ours, run(split(short_attention.attend), torch.float32)):
        assert torch.equal(a, b_)
    for a, ref in zip(ours, run(split(F.scaled_dot_product_attention), torch.float64)):
        torch.testing.assert_close(a.double(), ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert torch.equal(short_attention.attend_q_kv(q64.float(), kv64.float(), h, scale), ours[0])
    assert short_attention.usable_q_kv(q64.float(), kv64.float(), h)
    assert not short_attention.usable_q_kv(q64.float(), kv64.float()[..., :-d], h)  # kv not twice q's width
    assert not short_attention.usable_q_kv(torch.zeros(b, nq, 2 * h * d)[..., :h * d], kv64.float(), h)  # strided


@needs_kernel
def test_multi_head_attention_matches_torch_multihead_attention(monkeypatch):
    calls = []
    real = short_attention.attend_qkv
    monkeypatch.setattr(short_attention, "attend_qkv", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    ours = kernels.apply(MultiHeadAttention(128, 4))
    ref = torch.nn.MultiheadAttention(128, 4, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.in_proj_bias.copy_(ours.qkv.bias)
        ref.out_proj.weight.copy_(ours.proj.weight)
        ref.out_proj.bias.copy_(ours.proj.bias)
    x = torch.randn(4, 50, 128)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref_out = ours(xa), ref(xb, xb, xb, need_weights=False)[0]
    assert calls == [1]  # the kernel ran, straight from qkv
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours.qkv.weight.grad, ref.in_proj_weight.grad, atol=1e-5, rtol=1e-4)


@needs_kernel
def test_vit_training_gradients_match_pytorch_kernels(monkeypatch):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", mlp_ratio=4.0, depth=2, kernels=True)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))

    def grads():
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = grads()
    monkeypatch.setattr(short_attention, "usable", lambda *a: False)
    assert_grads_close(ours, grads(), 1e-4)


@needs_any_length
def test_long_sequence_vit_training_gradients_match_pytorch_kernels(monkeypatch):
    long_vit_grads_against_pytorch(monkeypatch, torch.float32, 1e-4)


@needs_kernel
def test_double_backward_says_it_is_not_supported():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 8, 8, 32))
    out = short_attention.attend(q, k, v)
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gq.sum().backward()

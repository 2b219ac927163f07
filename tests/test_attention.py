"""vitscope.attention against references we did not write: a float64 softmax formula written here,
torch's fused kernel, and torch.nn.MultiheadAttention with copied weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

import vitscope.attention as attention
from helpers import torch_mha_like
from vitscope.attention import (
    EXPLICIT_HALF_MAX_KEYS,
    EXPLICIT_HALF_MAX_QUERIES,
    AdditiveAttention,
    KVCache,
    MultiHeadAttention,
    SpatialSelfAttention,
    attend,
    dot_product_attention,
    key_padding_mask,
)

F32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


def reference(q, k, v, mask=None, scale=None):
    """softmax(q kᵀ · scale + mask) v in float64; a row with no key gets zero weights."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.double()
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v), weights


def qkv(b, h, nq, nk, d, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for n in (nq, nk, nk))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def make_mask(kind, b, h, nq, nk, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "bool_qk":  # (1, 1, Nq, Nk): shared by batch and heads
        return torch.rand(1, 1, nq, nk, generator=g) > 0.4
    if kind == "bool_bk":  # (B, 1, 1, Nk): key padding
        return torch.rand(b, 1, 1, nk, generator=g) > 0.3
    if kind == "bool_2d":  # (Nq, Nk)
        return torch.rand(nq, nk, generator=g) > 0.5
    if kind == "float_full":  # (B, H, Nq, Nk) additive bias
        return torch.randn(b, h, nq, nk, generator=g)
    if kind == "float_inf":  # (1, H, Nq, Nk) with -inf entries
        m = torch.randn(1, h, nq, nk, generator=g)
        return m.masked_fill(torch.rand(1, h, nq, nk, generator=g) > 0.6, -math.inf)
    raise ValueError(kind)


SHAPES = [(2, 3, 5, 7, 8), (1, 2, 9, 4, 16), (3, 1, 6, 6, 4)]
MASKS = [None, "bool_qk", "bool_bk", "bool_2d", "float_full", "float_inf"]


# -- attend: values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASKS)
def test_attend_fused_explicit_and_formula_agree(shape, kind):
    b, h, nq, nk, d = shape
    q, k, v = qkv(b, h, nq, nk, d)
    mask = make_mask(kind, b, h, nq, nk)
    want, want_w = reference(q, k, v, mask)
    fused = attend(q, k, v, mask=mask)
    explicit, weights = attend(q, k, v, mask=mask, return_weights=True)
    assert weights.shape == (b, h, nq, nk)
    torch.testing.assert_close(fused.double(), want, **F32)
    torch.testing.assert_close(explicit.double(), want, **F32)
    torch.testing.assert_close(weights.double(), want_w, **F32)


def test_attend_scale():
    q, k, v = qkv(2, 2, 5, 6, 8)
    want, _ = reference(q, k, v, scale=0.3)
    torch.testing.assert_close(attend(q, k, v, scale=0.3).double(), want, **F32)
    torch.testing.assert_close(attend(q, k, v, scale=0.3, return_weights=True)[0].double(), want, **F32)


def test_causal_matches_torch_is_causal():
    q, k, v = qkv(2, 3, 7, 7, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attend(q, k, v, causal=True), want, **F32)
    out, w = attend(q, k, v, causal=True, return_weights=True)
    torch.testing.assert_close(out, want, **F32)
    assert (w.triu(diagonal=1) == 0).all()


def test_causal_with_fewer_queries_aligns_last_query_with_last_key():
    # The decoding case: 3 new queries over 8 keys; query i sees keys j <= i + 5.
    q, k, v = qkv(2, 2, 3, 8, 8)
    tri = torch.ones(3, 8, dtype=torch.bool).tril(diagonal=8 - 3)
    want, _ = reference(q, k, v, tri)
    torch.testing.assert_close(attend(q, k, v, causal=True).double(), want, **F32)
    torch.testing.assert_close(attend(q, k, v, causal=True, return_weights=True)[0].double(), want, **F32)


@pytest.mark.parametrize("kind", ["bool_bk", "bool_qk", "float_full", "float_inf"])
def test_causal_combined_with_mask(kind):
    b, h, n, d = 2, 3, 6, 8
    q, k, v = qkv(b, h, n, n, d)
    mask = make_mask(kind, b, h, n, n)
    tri = torch.ones(n, n, dtype=torch.bool).tril()
    combined = mask & tri if mask.dtype == torch.bool else mask.masked_fill(~tri, -math.inf)
    want, _ = reference(q, k, v, combined)
    torch.testing.assert_close(attend(q, k, v, mask=mask, causal=True).double(), want, **F32)
    out, _ = attend(q, k, v, mask=mask, causal=True, return_weights=True)
    torch.testing.assert_close(out.double(), want, **F32)


@pytest.mark.parametrize("float_mask", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_gradients(float_mask):
    b, h, nq, nk, d = 2, 2, 4, 5, 8
    mask = torch.ones(b, 1, nq, nk, dtype=torch.bool)
    mask[0, :, 1] = False  # batch 0, query 1: nothing to look at
    mask[1, :, :, 3:] = False
    if float_mask:
        mask = torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
    for return_weights in (False, True):
        q, k, v = qkv(b, h, nq, nk, d, grad=True)
        out = attend(q, k, v, mask=mask, return_weights=return_weights)
        out, w = out if return_weights else (out, None)
        assert not out.isnan().any()
        assert (out[0, :, 1] == 0).all()
        if w is not None:
            assert (w[0, :, 1] == 0).all() and not w.isnan().any()
        out.square().sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        # An empty row contributes nothing, so no gradient flows into its query.
        assert (q.grad[0, :, 1] == 0).all()
        torch.testing.assert_close(out.double(), reference(q, k, v, mask)[0], **F32)


def test_gradients_agree_between_paths_and_formula():
    b, h, nq, nk, d = 2, 3, 5, 7, 8
    mask = make_mask("bool_bk", b, h, nq, nk) | torch.eye(nq, nk, dtype=torch.bool)
    upstream = torch.randn(b, h, nq, d, generator=torch.Generator().manual_seed(5))

    def grads(fn):
        q, k, v = qkv(b, h, nq, nk, d, grad=True)
        (fn(q, k, v) * upstream).sum().backward()
        return [t.grad.double() for t in (q, k, v)]

    fused = grads(lambda q, k, v: attend(q, k, v, mask=mask, causal=True))
    explicit = grads(lambda q, k, v: attend(q, k, v, mask=mask, causal=True, return_weights=True)[0])
    tri = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    ref = grads(lambda q, k, v: reference(q, k, v, mask & tri)[0].float())
    for a, b_, c in zip(fused, explicit, ref):
        torch.testing.assert_close(a, c, **F32)
        torch.testing.assert_close(b_, c, **F32)


@pytest.mark.parametrize("kind", [None, "bool_bk", "float_full"])
def test_bfloat16_paths_agree_with_formula(kind):
    b, h, nq, nk, d = 2, 2, 9, 11, 16
    mask = make_mask(kind, b, h, nq, nk)
    want, want_w = reference(*qkv(b, h, nq, nk, d, dtype=torch.bfloat16), mask)
    q, k, v = qkv(b, h, nq, nk, d, dtype=torch.bfloat16)
    fused = attend(q, k, v, mask=mask)
    explicit, w = attend(q, k, v, mask=mask, return_weights=True)
    assert fused.dtype == explicit.dtype == torch.bfloat16
    torch.testing.assert_close(fused.double(), want, **BF16)
    torch.testing.assert_close(explicit.double(), want, **BF16)
    torch.testing.assert_close(w.double(), want_w, **BF16)
    # Training in bfloat16 (the explicit path for short sequences): same values, gradients match.
    gq, gk, gv = qkv(b, h, nq, nk, d, dtype=torch.bfloat16, grad=True)
    out = attend(gq, gk, gv, mask=mask)
    torch.testing.assert_close(out.double(), want, **BF16)
    out.float().sum().backward()
    rq, rk, rv = (t.detach().double().requires_grad_() for t in qkv(b, h, nq, nk, d, dtype=torch.bfloat16))
    reference(rq, rk, rv, mask)[0].sum().backward()
    for got, ref in zip((gq, gk, gv), (rq, rk, rv)):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=5e-2, rtol=5e-2)


def test_half_precision_weights_cost_no_accuracy_against_a_float32_copy():
    """The explicit path keeps bfloat16 weights for training: its output and gradients are as close to
    the float64 formula as those of float32 weights cast down for the values product."""
    b, h, n, d = 4, 2, 50, 32
    q, k, v = qkv(b, h, n, n, d, dtype=torch.bfloat16)
    rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
    want = reference(rq, rk, rv, None)[0]
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (rq, rk, rv), g)

    def errors(dtype):
        tq, tk, tv = (t.clone().requires_grad_() for t in (q, k, v))
        w = attention.attention_weights(tq, tk, dtype=dtype)
        assert w.dtype == dtype
        out = w.to(tv.dtype) @ tv
        grads = torch.autograd.grad(out, (tq, tk, tv), g.to(out.dtype))
        rel = [((a.double() - c).norm() / c.norm()).item() for a, c in zip((out, *grads), (want, *want_grads))]
        return rel

    half, single = errors(torch.bfloat16), errors(torch.float32)
    for a, c in zip(half, single):
        assert a <= 1.1 * c, (half, single)  # measured: 0.5-0.6% relative error either way


# -- attend: dropout and kernel choice --------------------------------------------------------------
@pytest.mark.parametrize("return_weights", [False, True])
def test_dropout_changes_output_and_is_seeded(return_weights):
    q, k, v = qkv(2, 2, 6, 6, 8)

    def run(p, seed=0):
        torch.manual_seed(seed)
        out = attend(q, k, v, dropout_p=p, return_weights=return_weights)
        return out[0] if return_weights else out

    assert not torch.allclose(run(0.5), run(0.0))
    torch.testing.assert_close(run(0.5, seed=3), run(0.5, seed=3))


def test_multihead_attention_eval_ignores_attn_drop():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, attn_drop=0.9)
    plain = MultiHeadAttention(16, 4)
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(mha.eval()(x), plain.eval()(x))
    assert not torch.allclose(mha.train()(x), plain(x))


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.kwargs = kwargs
        return self.fn(*args, **kwargs)


@pytest.fixture
def spies(monkeypatch):
    fused = _Spy(attention.F.scaled_dot_product_attention)
    explicit = _Spy(attention.attention_weights)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", fused)
    monkeypatch.setattr(attention, "attention_weights", explicit)
    return fused, explicit


def test_float32_runs_fused_unless_weights_are_asked(spies):
    fused, explicit = spies
    q, k, v = qkv(1, 2, 5, 5, 8, grad=True)
    attend(q, k, v, causal=True).sum().backward()
    assert (fused.calls, explicit.calls) == (1, 0)
    attend(q, k, v, return_weights=True)
    assert (fused.calls, explicit.calls) == (1, 1)


def test_bfloat16_training_picks_kernel_by_length(spies):
    fused, explicit = spies
    q, k, v = qkv(1, 1, 4, 64, 8, dtype=torch.bfloat16, grad=True)
    attend(q, k, v).float().sum().backward()
    assert (fused.calls, explicit.calls) == (0, 1)  # short: the explicit path is faster backwards
    with torch.no_grad():
        attend(q, k, v)
    assert (fused.calls, explicit.calls) == (0, 2)  # inference, a few queries (decoding): explicit
    many = qkv(1, 1, EXPLICIT_HALF_MAX_QUERIES + 1, 64, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        attend(*many)
    assert (fused.calls, explicit.calls) == (1, 2)  # inference, more queries: fused
    # Long: fused, so the Nq x Nk weights are never materialised.
    q, k, v = qkv(1, 1, EXPLICIT_HALF_MAX_QUERIES + 1, EXPLICIT_HALF_MAX_KEYS + 1, 8, dtype=torch.bfloat16, grad=True)
    attend(q, k, v, mask=torch.ones(1, EXPLICIT_HALF_MAX_KEYS + 1, dtype=torch.bool)).float().sum().backward()
    assert (fused.calls, explicit.calls) == (2, 2)
    # Long causal self-attention uses the kernel's own causal mode: not even the bool mask is built.
    n = EXPLICIT_HALF_MAX_KEYS + 1
    q, k, v = qkv(1, 1, n, n, 8, dtype=torch.bfloat16, grad=True)
    attend(q, k, v, causal=True).float().sum().backward()
    assert (fused.calls, explicit.calls) == (3, 2)
    assert fused.kwargs.get("is_causal") and fused.kwargs.get("attn_mask") is None


def test_training_through_values_alone_counts_as_training(spies):
    fused, explicit = spies
    q, k, v = qkv(1, 1, 4, 8, 8, dtype=torch.bfloat16)
    v.requires_grad_()
    attend(q, k, v).float().sum().backward()
    assert (fused.calls, explicit.calls) == (0, 1)


# -- helpers --------------------------------------------------------------------------------------
def test_key_padding_mask_from_lengths_and_padded():
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    got = key_padding_mask(torch.tensor([3, 1, 5]))
    assert got.shape == (3, 1, 1, 5) and torch.equal(got[:, 0, 0], want)
    short = key_padding_mask(torch.tensor([3, 1, 2]), n=5)
    assert torch.equal(short[:, 0, 0, 3:], torch.zeros(3, 2, dtype=torch.bool))
    assert torch.equal(key_padding_mask(padded=~want)[:, 0, 0], want)
    with pytest.raises(ValueError, match="exactly one"):
        key_padding_mask(torch.tensor([1]), padded=want)
    # Used as a mask it equals dropping the padded keys.
    q, k, v = qkv(3, 2, 4, 5, 8)
    out = attend(q, k, v, mask=key_padding_mask(torch.tensor([3, 1, 5])))
    torch.testing.assert_close(out[1:2], attend(q[1:2], k[1:2, :, :1], v[1:2, :, :1]), **F32)


@pytest.mark.parametrize("scaled", [False, True])
def test_dot_product_attention_is_softmax_xxt_x(scaled):
    x = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(0))
    x64 = x.double()
    scores = x64 @ x64.transpose(1, 2) / (math.sqrt(5) if scaled else 1.0)
    w = torch.softmax(scores, -1)
    out, weights = dot_product_attention(x, scaled=scaled, return_weights=True)
    torch.testing.assert_close(out.double(), w @ x64, **F32)
    torch.testing.assert_close(weights.double(), w, **F32)


# -- MultiHeadAttention vs torch.nn.MultiheadAttention ----------------------------------------------
def _randomise(module):
    # Non-trivial biases, so a swapped q/k/v slice would show.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


B, N, M, DIM, HEADS = 2, 6, 4, 16, 4
_lengths = torch.tensor([4, 6])
PADDED = torch.arange(N)[None] >= _lengths[:, None]  # (B, N), True = padding (MHA's convention)
NOT_ALLOWED = torch.rand(N, N, generator=torch.Generator().manual_seed(3)) > 0.6  # MHA: True = blocked
NOT_ALLOWED.fill_diagonal_(False)
FLOAT_MASK = torch.randn(N, N, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("case", ["plain", "key_padding", "bool_attn_mask", "float_attn_mask", "both"])
def test_self_attention_matches_torch(case):
    ours = _randomise(MultiHeadAttention(DIM, HEADS))
    ref = torch_mha_like(ours, DIM, HEADS)
    x = torch.randn(B, N, DIM, generator=torch.Generator().manual_seed(0))
    kpm = PADDED if case in ("key_padding", "both") else None
    attn_mask = {"bool_attn_mask": NOT_ALLOWED, "both": NOT_ALLOWED, "float_attn_mask": FLOAT_MASK}.get(case)
    ours_mask = None
    if kpm is not None:
        ours_mask = key_padding_mask(padded=kpm)
    if attn_mask is not None:
        m = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
        ours_mask = m if ours_mask is None else (ours_mask & m)
    want, want_w = ref(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True,
                       average_attn_weights=True)
    out, w = ours(x, mask=ours_mask, return_weights=True)
    torch.testing.assert_close(out, want, **F32)
    torch.testing.assert_close(w.mean(1), want_w, **F32)
    torch.testing.assert_close(ours(x, mask=ours_mask), want, **F32)  # fused path too


@pytest.mark.parametrize("context_dim", [None, 12])
@pytest.mark.parametrize("padded", [False, True])
def test_cross_attention_matches_torch(context_dim, padded):
    ours = _randomise(MultiHeadAttention(DIM, HEADS, cross=True, context_dim=context_dim))
    ref = torch_mha_like(ours, DIM, HEADS, kdim=context_dim)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, N, DIM, generator=g)
    ctx = torch.randn(B, M, context_dim or DIM, generator=g)
    kpm = torch.tensor([[False, False, True, True], [False] * 4]) if padded else None
    want, want_w = ref(x, ctx, ctx, key_padding_mask=kpm, need_weights=True)
    mask = key_padding_mask(padded=kpm) if padded else None
    out, w = ours(x, ctx, mask=mask, return_weights=True)
    assert w.shape == (B, HEADS, N, M)
    torch.testing.assert_close(out, want, **F32)
    torch.testing.assert_close(w.mean(1), want_w, **F32)
    torch.testing.assert_close(ours(x, ctx, mask=mask), want, **F32)


@pytest.mark.parametrize("cross", [False, True])
def test_fewer_queries_match_torch_for_those_tokens(cross):
    """queries=n: the first n tokens' outputs, with every token (or the context) as keys and values."""
    ours = _randomise(MultiHeadAttention(DIM, HEADS, cross=cross))
    ref = torch_mha_like(ours, DIM, HEADS)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, N, DIM, generator=g)
    kv = torch.randn(B, M, DIM, generator=g) if cross else x
    kpm = torch.zeros(B, kv.shape[1], dtype=torch.bool)
    kpm[0, -2:] = True
    want = ref(x, kv, kv, key_padding_mask=kpm, need_weights=False)[0][:, :2]
    context = kv if cross else None
    out = ours(x, context, mask=key_padding_mask(padded=kpm), queries=2)
    assert out.shape == (B, 2, DIM)
    torch.testing.assert_close(out, want, **F32)
    out, w = ours(x, context, queries=2, return_weights=True)
    assert w.shape == (B, HEADS, 2, kv.shape[1])
    with pytest.raises(ValueError, match="key mask"):
        ours(x, context, causal=True, queries=2)


def test_self_attention_refuses_context():
    with pytest.raises(ValueError, match="cross=True"):
        MultiHeadAttention(DIM, HEADS)(torch.randn(1, 2, DIM), torch.randn(1, 3, DIM))


# -- key/value cache --------------------------------------------------------------------------------
@pytest.mark.parametrize("qk_norm", [False, True])
def test_kv_cache_decoding_equals_full_causal_recompute(qk_norm):
    mha = _randomise(MultiHeadAttention(DIM, HEADS, qk_norm=qk_norm))
    x = torch.randn(B, 7, DIM, generator=torch.Generator().manual_seed(0))
    full = mha(x, causal=True)
    cache = KVCache()
    steps = [mha(x[:, :3], causal=True, cache=cache)]  # a prompt chunk, then one token at a time
    for t in range(3, 7):
        steps.append(mha(x[:, t : t + 1], causal=True, cache=cache))
    assert len(cache) == 7
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **F32)


def test_kv_cache_cross_attention_reuses_context():
    mha = _randomise(MultiHeadAttention(DIM, HEADS, cross=True, context_dim=12))
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(B, 5, DIM, generator=g), torch.randn(B, M, 12, generator=g)
    cache = KVCache()
    first = mha(x[:, :2], ctx, cache=cache)
    later = mha(x[:, 2:], None, cache=cache)  # the context is no longer needed
    assert len(cache) == M
    torch.testing.assert_close(torch.cat([first, later], 1), mha(x, ctx), **F32)


# -- SpatialSelfAttention ---------------------------------------------------------------------------
@pytest.mark.parametrize("num_heads", [1, 4])
def test_spatial_self_attention_equals_written_out_definition(num_heads):
    c, h, w, groups = 8, 3, 5, 4
    sa = _randomise(SpatialSelfAttention(c, num_heads, groups=groups))
    x = torch.randn(2, c, h, w, generator=torch.Generator().manual_seed(0))
    out, weights = sa(x, return_weights=True)

    x64 = x.double()
    p = {n: t.double() for n, t in sa.named_parameters()}
    normed = F.group_norm(x64, groups, p["norm.weight"], p["norm.bias"], eps=sa.norm.eps)
    tokens = normed.flatten(2).transpose(1, 2)  # (N, H·W, C)
    q, k, v = (tokens @ p["attn.qkv.weight"].T + p["attn.qkv.bias"]).chunk(3, dim=-1)
    d = c // num_heads
    heads = []
    for i in range(num_heads):
        sl = slice(i * d, (i + 1) * d)
        a = torch.softmax(q[..., sl] @ k[..., sl].transpose(1, 2) / math.sqrt(d), dim=-1)
        torch.testing.assert_close(weights[:, i].double(), a, **F32)
        heads.append(a @ v[..., sl])
    y = torch.cat(heads, -1) @ p["attn.proj.weight"].T + p["attn.proj.bias"]  # (N, H·W, C)
    want = y.transpose(1, 2).reshape(2, c, h, w) + x64
    torch.testing.assert_close(out.double(), want, **F32)
    torch.testing.assert_close(sa(x).double(), want, **F32)


def test_spatial_self_attention_rejects_bad_norm():
    with pytest.raises(ValueError, match="norm must be"):
        SpatialSelfAttention(8, norm="instance")


# -- AdditiveAttention ------------------------------------------------------------------------------
def _additive_by_hand(att, query, keys, values, mask):
    """score[b, i, j] = vᵀ tanh(W_q q_i + W_k k_j + b_k), written with loops-free einsums in float64."""
    wq, wk, bk = att.query_proj.weight.double(), att.key_proj.weight.double(), att.key_proj.bias.double()
    vv = att.score.weight.double()[0]
    hq = torch.einsum("bqd,hd->bqh", query.double(), wq)
    hk = torch.einsum("bkd,hd->bkh", keys.double(), wk) + bk
    scores = torch.einsum("bqkh,h->bqk", torch.tanh(hq[:, :, None] + hk[:, None]), vv)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    w = torch.softmax(scores, -1).nan_to_num(0.0)
    return w @ values.double(), w


@pytest.mark.parametrize("single_query", [True, False])
def test_additive_attention(single_query):
    g = torch.Generator().manual_seed(0)
    att = _randomise(AdditiveAttention(query_dim=6, key_dim=5, hidden_dim=7))
    b, nq, nk = 3, 4, 5
    query = torch.randn(b, 6, generator=g) if single_query else torch.randn(b, nq, 6, generator=g)
    keys, values = torch.randn(b, nk, 5, generator=g), torch.randn(b, nk, 3, generator=g)
    mask = torch.ones(b, nk, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2] = False  # a sample with no key at all

    ctx, w = att(query, keys, values, mask=mask)
    q3 = query[:, None] if single_query else query
    want_ctx, want_w = _additive_by_hand(att, q3, keys, values, mask[:, None])
    if single_query:
        want_ctx, want_w = want_ctx[:, 0], want_w[:, 0]
        assert ctx.shape == (b, 3) and w.shape == (b, nk)
    else:
        assert ctx.shape == (b, nq, 3) and w.shape == (b, nq, nk)
    torch.testing.assert_close(ctx.double(), want_ctx, **F32)
    torch.testing.assert_close(w.double(), want_w, **F32)
    assert not ctx.isnan().any() and not w.isnan().any()
    torch.testing.assert_close(w[:2].sum(-1), torch.ones_like(w[:2].sum(-1)))
    assert (w[0, ..., 3:] == 0).all()
    assert (w[2] == 0).all() and (ctx[2] == 0).all()
    # Without a mask and values, keys are the values and every row sums to 1.
    ctx, w = att(query, keys)
    torch.testing.assert_close(ctx.double(), _additive_by_hand(att, q3, keys, keys, None)[0].squeeze(1)
                               if single_query else _additive_by_hand(att, q3, keys, keys, None)[0], **F32)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))


# -- capture and head ablation -----------------------------------------------------------------------
def test_capture_hook_receives_explicit_weights_and_leaves_output_unchanged():
    mha = _randomise(MultiHeadAttention(DIM, HEADS))
    x = torch.randn(B, N, DIM, generator=torch.Generator().manual_seed(0))
    plain = mha(x, causal=True)
    _, want = mha(x, causal=True, return_weights=True)
    seen = []
    mha.capture = lambda module, w: seen.append((module, w))
    out = mha(x, causal=True)
    assert len(seen) == 1 and seen[0][0] is mha
    torch.testing.assert_close(seen[0][1], want)
    torch.testing.assert_close(out, plain, **F32)
    # The weights are those of the formula, from the module's own projections.
    q, k, _ = rearrange(mha.qkv(x), "b n (three h d) -> three b h n d", three=3, h=HEADS)
    tri = torch.ones(N, N, dtype=torch.bool).tril()
    torch.testing.assert_close(want.double(), reference(q, k, k, tri)[1], **F32)


def test_head_mask_zeroes_that_heads_slice_before_proj():
    mha = _randomise(MultiHeadAttention(DIM, HEADS))
    x = torch.randn(B, N, DIM, generator=torch.Generator().manual_seed(0))
    q, k, v = rearrange(mha.qkv(x), "b n (three h d) -> three b h n d", three=3, h=HEADS)
    heads, _ = reference(q, k, v)  # (B, H, N, D)
    heads[:, 1] = 0
    want = mha.proj(rearrange(heads.float(), "b h n d -> b n (h d)"))
    mha.head_mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(mha(x), want, **F32)
    torch.testing.assert_close(mha(x, return_weights=True)[0], want, **F32)


def test_head_dim_divisibility():
    with pytest.raises(ValueError, match="dim=10 is not divisible by num_heads=4"):
        MultiHeadAttention(10, 4)
    mha = MultiHeadAttention(10, 4, head_dim=3)  # inner width 12, projected back to 10
    assert mha.qkv.out_features == 36 and mha(torch.randn(1, 5, 10)).shape == (1, 5, 10)


def test_additive_attention_takes_keys_projected_once():
    """An RNN decoder projects its keys once per sequence and passes them in: the same context and weights."""
    torch.manual_seed(0)
    att = attention.AdditiveAttention(12, 10, 8)
    q, k = torch.randn(3, 4, 12), torch.randn(3, 7, 10)
    mask = torch.rand(3, 7) > 0.3
    ctx, w = att(q, k, mask=mask)
    ctx2, w2 = att(q, k, mask=mask, projected_keys=att.key_proj(k))
    torch.testing.assert_close(ctx2, ctx, rtol=0, atol=0)
    torch.testing.assert_close(w2, w, rtol=0, atol=0)

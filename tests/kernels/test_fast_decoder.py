"""FastTransformerDecoder: a decoding step gives the plain decoder's logits and cross-attention (bit for bit
where the same ops run, to the kernel's rounding where a decode-attention kernel takes the attention: in
bfloat16 native/decode_attention.c, in float32 native/decode_attention_f32_avx2.c), runs only for one-token
inference steps that nothing observes, and follows changed weights. The decode-attention kernels themselves
are held to float64: their weights and outputs as close as `attend`'s in the same dtype.

`make test` runs this folder again under each smaller instruction set the CPU has (VITSCOPE_ISA): there the
kernel does not run and the steps go through `attend`."""

from __future__ import annotations

import copy

import pytest
import torch

from vitscope import kernels
from vitscope.attention import attend
from vitscope.decoder import TransformerDecoder
from vitscope.kernels import decode_attention, fused_linear, registry
from vitscope.kernels.fast_decoder import FastTransformerDecoder

BF = torch.bfloat16
KERNEL = registry.runs("decode attention", BF) is not None
NO_KERNEL = f"the decode-attention kernel does not run here: {registry.why_none('decode attention', BF)}"
F32_KERNEL = registry.runs("decode attention", torch.float32) is not None
NO_F32_KERNEL = ("the float32 decode-attention kernel does not run here: "
                 f"{registry.why_none('decode attention', torch.float32)}")


def _pair(context_dim: int = 24, mlp_ratio: float = 4.0) -> tuple[TransformerDecoder, TransformerDecoder]:
    torch.manual_seed(0)
    plain = TransformerDecoder(30, 64, 2, 4, 12, context_dim=context_dim, mlp_ratio=mlp_ratio).eval()
    return plain, kernels.apply(copy.deepcopy(plain))


def _decode(model, context, tokens, *, padding=None, groups=1, dtype=torch.float32):
    """Feed tokens (R, T) one at a time through fresh caches: every step's logits (R, T, V) and cross-attention
    (R, T, L, H, N)."""
    logits, weights = [], []
    caches = model.new_caches()
    with torch.inference_mode(), torch.autocast("cpu", dtype=BF, enabled=dtype == BF):
        for t in range(tokens.shape[1]):
            out, w = model(tokens[:, t:t + 1], context, context_padding_mask=padding, caches=caches,
                           return_weights=True)
            logits.append(out.float())
            weights.append(w.float())
    assert groups * context.shape[0] == tokens.shape[0]
    return torch.cat(logits, 1), torch.cat(weights, 1)


def _inputs(images: int = 3, groups: int = 1, n: int = 37, padded: bool = False):
    g = torch.Generator().manual_seed(1)
    context = torch.randn(images, n, 24, generator=g)
    tokens = torch.randint(0, 30, (images * groups, 7), generator=g)
    padding = None
    if padded:
        padding = torch.zeros(images, n, dtype=torch.bool)
        padding[0, n // 2:] = True
    return context, tokens, padding


@pytest.mark.parametrize("mlp_ratio", [4.0, 97 / 64], ids=["", "odd MLP width"])  # fc2's 97 inputs: not the kernel's
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded memory"])
@pytest.mark.parametrize("groups", [1, 3], ids=["one row per image", "3 beams per image"])
@pytest.mark.parametrize("dtype", [torch.float32, BF], ids=["float32", "bfloat16"])
def test_decoding_steps_give_the_plain_decoders_numbers(dtype, groups, padded, mlp_ratio, monkeypatch):
    plain, fast = _pair(mlp_ratio=mlp_ratio)
    context, tokens, padding = _inputs(groups=groups, padded=padded)
    ours = _decode(fast, context, tokens, padding=padding, groups=groups, dtype=dtype)
    with monkeypatch.context() as m:  # the same model, every step through the plain decoder's modules
        m.setattr(FastTransformerDecoder, "_one_token", lambda *a: False)
        stepwise = _decode(fast, context, tokens, padding=padding, groups=groups, dtype=dtype)
    unswapped = _decode(plain, context, tokens, padding=padding, groups=groups, dtype=dtype)
    # against PyTorch's modules alone: as every fast module is held (test_fast_modules.py)
    tolerance = {torch.float32: (2e-5, 1e-4), BF: (3e-2, 5e-2)}[dtype]
    torch.testing.assert_close(ours, unswapped, atol=tolerance[0], rtol=tolerance[1])
    # float32 steps take F.linear, the modules the kernels' products on AMD CPUs (fused_linear.float32_available)
    kernels_differ = KERNEL if dtype == BF else F32_KERNEL or fused_linear.float32_available()
    if not kernels_differ:  # the same ops on the same tensors: the same bits
        torch.testing.assert_close(ours, stepwise, atol=0, rtol=0)
        return
    if padded:
        assert ours[1][:groups, :, :, :, context.shape[1] // 2:].abs().max() == 0  # padded tokens get nothing
    if dtype == torch.float32:  # exp and sums in another order than the modules': float32 rounding
        torch.testing.assert_close(ours, stepwise, atol=1e-6, rtol=1e-5)
        return
    if registry.runs("linear product", BF) is not None:  # each layer packed for the product kernel where it takes it
        packed = {m: entry[2] is not None for m, entry in fast._cast[1].items()}
        assert packed[fast.blocks[0].self_attn.qkv] and packed[fast.blocks[0].mlp.fc2] == (mlp_ratio == 4.0)
    # the kernel keeps the scores in float32 where attend rounds them to bfloat16: weights within that rounding
    torch.testing.assert_close(ours[1], stepwise[1], atol=4e-3, rtol=2e-2)
    torch.testing.assert_close(ours[0], stepwise[0], atol=3e-2, rtol=5e-2)


def test_the_fast_step_runs_for_one_token_inference_steps_only(monkeypatch):
    plain, fast = _pair()
    context, tokens, _ = _inputs()
    calls = []
    step = FastTransformerDecoder._step
    monkeypatch.setattr(FastTransformerDecoder, "_step", lambda self, *a: calls.append(1) or step(self, *a))

    def steps(**kw) -> int:
        calls.clear()
        _decode(fast, context, tokens, **kw)
        return len(calls)

    assert steps() == tokens.shape[1] - 1  # the first step fills the caches through the plain decoder
    with kernels.disabled():
        assert steps() == 0
    handle = fast.blocks[1].mlp.register_forward_hook(lambda *a: None)
    assert steps() == 0  # a hook would see the modules called
    handle.remove()
    fast.blocks[0].cross_attn.head_mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert steps() == 0
    fast.blocks[0].cross_attn.head_mask = None
    fast.train()
    assert steps() == 0
    fast.eval()
    calls.clear()
    with torch.no_grad():  # teacher forcing: many tokens in one call
        fast(tokens, context)
    assert not calls
    assert steps() == tokens.shape[1] - 1


def test_a_changed_weight_is_cast_again(monkeypatch):
    plain, fast = _pair()
    context, tokens, _ = _inputs()
    _decode(fast, context, tokens, dtype=BF)
    with torch.no_grad():
        for model in (plain, fast):
            model.blocks[1].mlp.fc2.weight.mul_(-3.0)  # in place: the version counter moves
            model.head.bias.add_(0.5)
    ours, theirs = _decode(fast, context, tokens, dtype=BF), _decode(plain, context, tokens, dtype=BF)
    torch.testing.assert_close(ours[0], theirs[0], atol=5e-2, rtol=5e-2)


def test_copies_and_pickles_leave_the_kept_weights_behind():
    import pickle

    plain, fast = _pair()
    context, tokens, _ = _inputs()
    before = _decode(fast, context, tokens, dtype=BF)
    for twin in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert twin._cast is None and all(p is None for p in twin._packs)
        torch.testing.assert_close(_decode(twin, context, tokens, dtype=BF), before, atol=0, rtol=0)


@pytest.mark.skipif(not KERNEL, reason=NO_KERNEL)
@pytest.mark.parametrize("shape", [(32, 4, 1, 196, 32), (3, 2, 5, 37, 16), (2, 3, 4, 20, 64), (2, 2, 1, 16, 128),
                                   (4, 1, 3, 1, 32)], ids=lambda s: "B{} H{} G{} N{} D{}".format(*s))
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
def test_the_decode_attention_kernel_is_as_close_to_float64_as_attend(shape, masked):
    b, h, g, n, d = shape
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(b, h, rows, d, generator=gen).to(BF) for rows in (g, n, n))
    keep = None
    if masked:
        keep = torch.rand(b, 1, 1, n, generator=gen) > 0.3
        keep[0] = False  # an image whose every token is padding: zero weights, zero output
    assert decode_attention.usable(q, k, v, keep)
    out, w = decode_attention.attend(q, decode_attention.pack(k, v), n, d ** -0.5, keep)
    ref_out, ref_w = attend(q.double(), k.double(), v.double(), mask=keep, scale=d ** -0.5, return_weights=True)
    bf_out, bf_w = attend(q, k, v, mask=keep, scale=d ** -0.5, return_weights=True)
    out = out.view(b, g, h, d).transpose(1, 2).double()
    assert (w.double() - ref_w).abs().max() <= max(1e-6, (bf_w.double() - ref_w).abs().max())
    # both round each output to bfloat16 once, which alone may differ by a unit in the last place (2^-8 relative)
    assert (out - ref_out).abs().max() <= (bf_out.double() - ref_out).abs().max() + 2 ** -8 * ref_out.abs().max()
    assert (w.sum(-1) - (ref_w.sum(-1))).abs().max() < 1e-5  # rows sum to 1 (0 where nothing may be seen)
    _, no_w = decode_attention.attend(q, decode_attention.pack(k, v), n, d ** -0.5, keep, weights=False)
    assert no_w is None


@pytest.mark.skipif(not F32_KERNEL, reason=NO_F32_KERNEL)
@pytest.mark.parametrize("shape", [(32, 4, 1, 196, 32), (3, 2, 5, 37, 16), (2, 3, 4, 20, 64), (2, 2, 1, 16, 128),
                                   (4, 1, 3, 1, 32), (5, 2, 1, 9, 8)], ids=lambda s: "B{} H{} G{} N{} D{}".format(*s))
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
def test_the_float32_decode_attention_kernel_is_as_close_to_float64_as_attend(shape, masked):
    b, h, g, n, d = shape
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(b, h, g, d, generator=gen)
    # keys and values read in place: every head's rows inside a longer cache, as a step's self-attention reads them
    k, v = (torch.randn(b, h, n + 3, d, generator=gen)[:, :, 1:n + 1] for _ in range(2))
    keep = None
    if masked:
        keep = torch.rand(b, 1, 1, n, generator=gen) > 0.3
        keep[0] = False  # an image whose every token is padding: zero weights, zero output
    assert decode_attention.usable(q, k, v, keep)
    out, w = decode_attention.attend_f32(q, k, v, d ** -0.5, keep)
    ref_out, ref_w = attend(q.double(), k.double(), v.double(), mask=keep, scale=d ** -0.5, return_weights=True)
    f32_out, f32_w = attend(q, k, v, mask=keep, scale=d ** -0.5, return_weights=True)
    out = out.view(b, g, h, d).transpose(1, 2).double()
    # float32 rounding, as attend's: at most three times its error, or a few units in the last place of the largest
    assert (w.double() - ref_w).abs().max() <= max(3 * (f32_w.double() - ref_w).abs().max(), 4 * 2 ** -24)
    assert (out - ref_out).abs().max() <= max(3 * (f32_out.double() - ref_out).abs().max(),
                                              4 * 2 ** -24 * ref_out.abs().max())
    if masked:
        assert w[0].abs().max() == 0 and out[0].abs().max() == 0
    out_only, no_w = decode_attention.attend_f32(q, k, v, d ** -0.5, keep, weights=False)
    assert no_w is None and torch.equal(out_only.view(b, g, h, d).transpose(1, 2).double(), out)


def test_the_decode_attention_kernels_refuse_what_they_cannot_take():
    for dtype, multiple, kernel in ((BF, 16, KERNEL), (torch.float32, 8, F32_KERNEL)):
        q, k = torch.randn(2, 2, 1, 32).to(dtype), torch.randn(2, 2, 9, 32).to(dtype)
        assert decode_attention.usable(q, k, k) == kernel
        assert not decode_attention.usable(q.double(), k.double(), k.double())  # float64
        odd = 32 - multiple // 2  # head dim not a multiple of the kernel's
        assert not decode_attention.usable(q[..., :odd], k[..., :odd], k[..., :odd])
        assert not decode_attention.usable(q, k, k, torch.ones(2, 9, dtype=torch.bool))  # not an attend key mask
        strided = torch.randn(2, 2, 32, 2).to(dtype).transpose(-1, -2)  # head dims not contiguous
        assert not decode_attention.usable(strided, k, k)
        with torch.enable_grad():
            assert not decode_attention.usable(q.requires_grad_(), k, k)
    strided_keys = torch.randn(2, 2, 32, 9).transpose(-1, -2)  # float32 reads k and v in place: unit-stride dims
    assert not decode_attention.usable(torch.randn(2, 2, 1, 32), strided_keys, strided_keys)


def test_the_fast_decoder_overrides_the_plain_steps_seams_not_the_step():
    """The one-token step is written once, in vitscope/decoder.py; the kernels' decoder chooses when it runs
    (`forward`) and how its linear layers, self- and cross-attention and MLP run, never its block loop."""
    overridden = {name for name, value in vars(FastTransformerDecoder).items()
                  if callable(value) and name in dir(TransformerDecoder) and not name.startswith("__")}
    assert overridden == {"forward", "step_linears", "step_self_attention", "step_cross_attention", "step_mlp"}

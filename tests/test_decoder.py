"""vitscope.decoder: cached decoding equals recomputing, masks keep what they should out, and the
attention inside stays inspectable."""

from __future__ import annotations

import pytest
import torch

from vitscope.decoder import DecoderBlock, TransformerDecoder, keep_mask

VOCAB, DIM, DEPTH, HEADS, MAX_LEN, CTX_DIM, M = 11, 16, 2, 4, 12, 12, 5
F32 = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def decoder() -> TransformerDecoder:
    torch.manual_seed(0)
    dec = TransformerDecoder(VOCAB, DIM, DEPTH, HEADS, MAX_LEN, context_dim=CTX_DIM)
    with torch.no_grad():  # weights large enough that every token and position matters
        for p in dec.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return dec.eval()


def _inputs(b: int = 2, t: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g), torch.randn(b, M, CTX_DIM, generator=g)


def test_shapes_and_context_width(decoder):
    tokens, ctx = _inputs()
    assert decoder(tokens, ctx).shape == (2, 7, VOCAB)
    assert decoder.blocks[0].cross_attn.kv.in_features == CTX_DIM


def test_cached_decoding_equals_full_recompute(decoder):
    tokens, ctx = _inputs()
    full = decoder(tokens, ctx)
    caches = decoder.new_caches()
    steps = [decoder(tokens[:, :3], ctx, caches=caches)]  # a prompt, then one token at a time
    for t in range(3, tokens.shape[1]):
        steps.append(decoder(tokens[:, t : t + 1], None, caches=caches))
    assert len(caches[0][0]) == tokens.shape[1] and len(caches[0][1]) == M
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **F32)


def test_future_tokens_do_not_change_earlier_logits(decoder):
    tokens, ctx = _inputs()
    changed = tokens.clone()
    changed[:, 4] = (changed[:, 4] + 1) % VOCAB
    a, b = decoder(tokens, ctx), decoder(changed, ctx)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_tokens_do_not_affect_the_others(decoder, side):
    tokens, ctx = _inputs()
    pad = torch.zeros_like(tokens, dtype=torch.bool)
    if side == "right":
        pad[0, 5:] = True
    else:
        pad[1, :2] = True
    other = tokens.masked_fill(pad, 3)
    garbage = tokens.masked_fill(pad, 9)
    a = decoder(other, ctx, padding_mask=pad)
    b = decoder(garbage, ctx, padding_mask=pad)
    assert not a.isnan().any()
    torch.testing.assert_close(a[~pad], b[~pad])
    # Without the mask the pad tokens would leak into later positions.
    if side == "left":
        assert not torch.allclose(decoder(other, ctx)[1, 2:], decoder(garbage, ctx)[1, 2:])


def test_context_padding_and_context_matter(decoder):
    tokens, ctx = _inputs()
    ctx_pad = torch.zeros(2, M, dtype=torch.bool)
    ctx_pad[0, 3:] = True
    noisy = ctx.clone()
    noisy[0, 3:] += 5.0
    torch.testing.assert_close(decoder(tokens, ctx, context_padding_mask=ctx_pad),
                               decoder(tokens, noisy, context_padding_mask=ctx_pad))
    # Cross-attention reads the context: a different image gives different logits everywhere.
    other = decoder(tokens, torch.randn_like(ctx))
    assert not torch.isclose(decoder(tokens, ctx), other).all(-1).any()


def test_padding_mask_must_cover_cached_tokens(decoder):
    tokens, ctx = _inputs()
    caches = decoder.new_caches()
    decoder(tokens[:, :3], ctx, caches=caches)
    with pytest.raises(ValueError, match="3 cached"):
        decoder(tokens[:, 3:4], ctx, caches=caches, padding_mask=torch.zeros(2, 1, dtype=torch.bool))
    decoder(tokens[:, 3:4], ctx, caches=caches, padding_mask=torch.zeros(2, 4, dtype=torch.bool))


def test_too_long_a_sequence_is_a_clear_error(decoder):
    with pytest.raises(ValueError, match="exceeds"):
        decoder(torch.zeros(1, MAX_LEN + 1, dtype=torch.long), torch.randn(1, M, CTX_DIM))


def test_block_weights_and_capture_hook():
    torch.manual_seed(0)
    block = DecoderBlock(DIM, HEADS, context_dim=CTX_DIM).eval()
    x, ctx = torch.randn(2, 6, DIM), torch.randn(2, M, CTX_DIM)
    out, self_w, cross_w = block(x, ctx, return_weights=True)
    torch.testing.assert_close(out, block(x, ctx))
    assert self_w.shape == (2, HEADS, 6, 6) and cross_w.shape == (2, HEADS, 6, M)
    assert (self_w.triu(diagonal=1) == 0).all()  # the self-attention is causal
    seen = {}
    block.self_attn.capture = lambda m, w: seen.__setitem__("self", w)
    block.cross_attn.capture = lambda m, w: seen.__setitem__("cross", w)
    torch.testing.assert_close(block(x, ctx), out, **F32)
    torch.testing.assert_close(seen["self"], self_w)
    torch.testing.assert_close(seen["cross"], cross_w)


def test_rows_sharing_a_context_equal_the_context_copied_per_row(decoder):
    """Beams of one image read its context once: B·G token rows against B context rows give what
    each row gives against its own copy, cached or not, weights included."""
    tokens, ctx = _inputs(b=6, t=5)
    ctx = ctx[:2]  # two images, three rows (beams) each
    pad = torch.zeros(2, M, dtype=torch.bool)
    pad[1, 3:] = True
    copied, copied_pad = ctx.repeat_interleave(3, 0), pad.repeat_interleave(3, 0)
    want, want_w = decoder(tokens, copied, context_padding_mask=copied_pad, return_weights=True)
    got, got_w = decoder(tokens, ctx, context_padding_mask=pad, return_weights=True)
    torch.testing.assert_close(got, want, **F32)
    torch.testing.assert_close(got_w, want_w, **F32)
    caches = decoder.new_caches()
    steps = [decoder(tokens[:, :2], ctx, context_padding_mask=pad, caches=caches)]
    for t in range(2, tokens.shape[1]):
        steps.append(decoder(tokens[:, t:t + 1], None, context_padding_mask=pad, caches=caches))
    assert caches[0][1].k.shape[0] == 2  # the cross-attention cache holds one row per image
    torch.testing.assert_close(torch.cat(steps, 1), want, **F32)
    with pytest.raises(ValueError, match="cannot share 4 context rows"):
        decoder(tokens, torch.randn(4, M, CTX_DIM))




@pytest.mark.parametrize("weights", [False, True], ids=["logits", "with cross-attention"])
@pytest.mark.parametrize("groups", [1, 3], ids=["one row per image", "3 beams per image"])
def test_the_one_token_step_gives_forwards_numbers_bit_for_bit(decoder, groups, weights):
    """`_step`, the block in the few ops a decoding step needs (what vitscope.kernels' decoder runs through its
    seams), against forward's modules on caches filled alike: the same logits and cross-attention, every bit.
    (With weights both take `attend`'s explicit path, without them its fused one: each pair agrees.)"""
    tokens, ctx = _inputs(b=2 * groups, t=5)
    ctx = ctx[:2]
    pad = torch.zeros(2, M, dtype=torch.bool)
    pad[1, 3:] = True
    forwarded, stepped = decoder.new_caches(), decoder.new_caches()
    with torch.inference_mode():
        for caches in (forwarded, stepped):  # the prompt fills the caches through forward
            decoder(tokens[:, :2], ctx, context_padding_mask=pad, caches=caches)
        for t in range(2, tokens.shape[1]):
            token = tokens[:, t:t + 1]
            want = decoder(token, None, context_padding_mask=pad, caches=forwarded, return_weights=weights)
            got = decoder._step(token, keep_mask(pad), stepped, return_weights=weights)
            for g, w in zip(got, want) if weights else [(got, want)]:
                assert torch.equal(g, w)
    assert len(stepped[0][0]) == len(forwarded[0][0]) == tokens.shape[1]

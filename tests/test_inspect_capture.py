"""Capturing attention: equal to the explicit path, whatever kernel runs; restored; refused when too big."""

import importlib.util

import pytest
import torch

from vitscope import create_model
from vitscope.attention import attention_weights
from vitscope.inspect import CaptureTooLarge, capture_attention, capturing, estimate_bytes


def _model(**kw):
    torch.manual_seed(0)
    return create_model("vit_tiny_patch4_28", depth=2, embed_dim=32, num_heads=4, **kw).eval()


def _explicit_weights(model, x):
    """Each block's weights from `return_weights=True`, walking the blocks by hand."""
    out, t = [], model.embed(x)
    for block in model.blocks:
        _, w = block.attn(block.norm1(t), return_weights=True)
        out.append(w)
        t = block(t)
    return out


@pytest.mark.parametrize("batch", [1, 3])
def test_capture_equals_return_weights(batch):
    model = _model(img_size=(28, 20))
    x = torch.randn(batch, 1, 28, 20)
    cap = capture_attention(model, x)
    with torch.no_grad():
        ref = _explicit_weights(model, x)
    assert cap.names == ["blocks.0.attn", "blocks.1.attn"]
    for got, want in zip(cap.layers(), ref):
        assert got.dtype == torch.float32 and got.shape == (batch, 4, 1 + 7 * 5, 1 + 7 * 5)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    lay = cap.layout
    assert (lay.num_prefix_tokens, lay.grid, lay.patch_size, lay.image_size) == (1, (7, 5), 4, (28, 20))


def test_capture_while_the_fused_kernel_runs():
    """The plain forward runs PyTorch's fused kernel in float32; the capture still gets the weights
    of the explicit softmax(q kᵀ/√d), and the model's output is the same as without a capture."""
    model = _model()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        plain = model(x)
        cap = capture_attention(model, x)
        torch.testing.assert_close(cap.output, plain, atol=1e-5, rtol=1e-5)
        attn = model.blocks[0].attn
        t = model.blocks[0].norm1(model.embed(x))
        q, k, _ = attn._project(t, None, None)
        torch.testing.assert_close(cap[0], attention_weights(q, k, scale=attn.scale), atol=1e-6, rtol=1e-5)


def test_layers_by_index_name_and_pattern():
    model = create_model("vit_tiny_patch4_28", depth=4, embed_dim=32, num_heads=2).eval()
    x = torch.randn(1, 1, 28, 28)
    assert capture_attention(model, x, layers=[0, -1]).names == ["blocks.0.attn", "blocks.3.attn"]
    assert capture_attention(model, x, layers="blocks.2.*").names == ["blocks.2.attn"]
    with pytest.raises(ValueError, match="out of range"):
        capture_attention(model, x, layers=[7])
    with pytest.raises(ValueError, match="no attention module matches"):
        capture_attention(model, x, layers=["decoder.*"])


def test_context_manager_restores_capture_even_on_error():
    model = _model()
    sentinel = lambda m, w: None  # noqa: E731
    model.blocks[1].attn.capture = sentinel
    with pytest.raises(ValueError, match="channel"):
        with capturing(model) as cap:
            model(torch.randn(1, 3, 28, 28))  # wrong channel count: the forward raises
    assert model.blocks[0].attn.capture is None and model.blocks[1].attn.capture is sentinel
    with capturing(model, layers=[1]) as cap:
        model(torch.randn(2, 1, 28, 12))
    assert cap.layout.grid == (7, 3) and cap[0].shape == (2, 4, 22, 22)
    assert model.blocks[1].attn.capture is sentinel


def test_estimate_and_refusal_say_the_numbers():
    model = _model()
    x = torch.randn(4, 1, 28, 28)
    assert estimate_bytes(model, x) == 2 * 4 * 4 * 50 * 50 * 4
    assert estimate_bytes(model, x, layers=[1]) == 4 * 4 * 50 * 50 * 4
    with pytest.raises(CaptureTooLarge, match=r"312\.5 KiB \(78\.1 KiB per image\).*fewer layers.*batch"):
        capture_attention(model, x, max_bytes=10_000)
    assert all(b.attn.capture is None for b in model.blocks)
    # the running check also stops captures the estimate cannot foresee
    with pytest.raises(CaptureTooLarge):
        with capturing(model, max_bytes=100_000):
            model(x)
    assert all(b.attn.capture is None for b in model.blocks)


@pytest.mark.skipif(importlib.util.find_spec("vitscope.decoder") is None,
                    reason="vitscope.decoder is not written yet")
def test_decoder_self_and_cross_attention():
    from vitscope.decoder import TransformerDecoder

    torch.manual_seed(0)
    dec = TransformerDecoder(vocab_size=20, dim=32, depth=2, num_heads=4, max_len=16, context_dim=24).eval()
    tokens, context = torch.randint(0, 20, (2, 5)), torch.randn(2, 7, 24)
    cap = capture_attention(dec, tokens, forward_kwargs={"context": context})
    assert cap.names == ["blocks.0.self_attn", "blocks.0.cross_attn",
                         "blocks.1.self_attn", "blocks.1.cross_attn"]
    assert cap.layout is None
    assert cap["blocks.1.self_attn"].shape == (2, 4, 5, 5)
    assert cap["blocks.1.cross_attn"].shape == (2, 4, 5, 7)
    assert torch.all(cap["blocks.0.self_attn"].triu(1) == 0)  # causal
    with torch.no_grad():
        x = dec.drop(dec.pos_embed(dec.token_embed(tokens), offset=0))
        _, self_w, cross_w = dec.blocks[0](x, context, return_weights=True)
    torch.testing.assert_close(cap["blocks.0.self_attn"], self_w)
    torch.testing.assert_close(cap["blocks.0.cross_attn"], cross_w)

"""vitscope.positional against the formulas of the papers and a direct F.interpolate."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange

from vitscope.positional import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    resample_pos_embed,
    sincos_1d,
    sincos_2d,
)
from vitscope.vit import VisionTransformer


def test_sincos_1d_matches_the_transformer_formula():
    n, d = 50, 16
    pe = sincos_1d(n, d)
    assert pe.shape == (n, d) and pe.dtype == torch.float32
    for p, i in [(0, 0), (1, 0), (7, 3), (49, 7), (23, 5)]:
        angle = p / 10000 ** (2 * i / d)
        assert pe[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    with pytest.raises(ValueError, match="even"):
        sincos_1d(4, 5)


def test_sincos_2d_layout_x_then_y():
    h, w, d = 3, 5, 16
    q = d // 4
    pe = rearrange(sincos_2d(h, w, d), "(h w) d -> h w d", h=h, w=w)
    # First half depends only on the column (x), second half only on the row (y).
    assert torch.equal(pe[:, :, : 2 * q], pe[:1, :, : 2 * q].expand(h, -1, -1))
    assert torch.equal(pe[:, :, 2 * q :], pe[:, :1, 2 * q :].expand(-1, w, -1))
    assert not torch.equal(pe[:, 0, :q], pe[:, 1, :q])
    assert not torch.equal(pe[0, :, 2 * q : 3 * q], pe[1, :, 2 * q : 3 * q])
    # Values: vit-pytorch's simple_vit, omega_i = 1 / 10000^(i / (d/4 - 1)).
    for row, col, i in [(2, 4, 1), (1, 3, 3), (0, 2, 2)]:
        omega = 1 / 10000 ** (i / (q - 1))
        assert pe[row, col, i].item() == pytest.approx(math.sin(col * omega), abs=1e-6)
        assert pe[row, col, q + i].item() == pytest.approx(math.cos(col * omega), abs=1e-6)
        assert pe[row, col, 2 * q + i].item() == pytest.approx(math.sin(row * omega), abs=1e-6)
        assert pe[row, col, 3 * q + i].item() == pytest.approx(math.cos(row * omega), abs=1e-6)
    with pytest.raises(ValueError, match="divisible by 4"):
        sincos_2d(2, 2, 6)


def test_sincos2d_vit_positions_are_fixed_not_learned():
    vit = VisionTransformer(img_size=(8, 12), patch_size=4, embed_dim=16, depth=1, num_heads=2,
                            num_classes=3, pos_embed="sincos2d").eval()
    assert not any("pos" in name for name, _ in vit.named_parameters())
    assert not any("pos" in name for name in vit.state_dict())  # recomputed, never saved
    assert "pos_embed_fixed" in dict(vit.named_buffers())  # a buffer: follows .to(device/dtype)
    x = torch.randn(2, 3, 8, 12)
    with torch.no_grad():
        patches = vit.patch_embed(x)
        cls = vit.cls_token.expand(2, -1, -1)
        want = torch.cat([cls, patches + sincos_2d(2, 3, 16)], dim=1)  # CLS gets no position
        torch.testing.assert_close(vit.embed(x), want)
        # another grid computes its own encoding rather than resampling
        x2 = torch.randn(1, 3, 12, 8)
        want2 = torch.cat([vit.cls_token, vit.patch_embed(x2) + sincos_2d(3, 2, 16)], dim=1)
        torch.testing.assert_close(vit.embed(x2), want2)


def _table(prefix: int, h: int, w: int, d: int = 6) -> torch.Tensor:
    return torch.randn(1, prefix + h * w, d, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize(("old", "new"), [((4, 4), (6, 6)), ((4, 4), (3, 7)), ((3, 5), (6, 2))])
def test_resample_equals_direct_bicubic_interpolation(old, new, antialias):
    table = _table(1, *old)
    out = resample_pos_embed(table, new, old if old[0] != old[1] else None, antialias=antialias)
    assert out.shape == (1, 1 + new[0] * new[1], 6)
    assert torch.equal(out[:, :1], table[:, :1])  # the CLS row is kept as it is
    grid = table[0, 1:].reshape(*old, 6).permute(2, 0, 1)[None]  # (1, D, h, w)
    want = F.interpolate(grid, size=new, mode="bicubic", align_corners=False, antialias=antialias)
    torch.testing.assert_close(out[0, 1:], want[0].permute(1, 2, 0).reshape(-1, 6))


def test_resample_identity_and_prefix_tokens():
    table = _table(2, 4, 4)
    assert torch.equal(resample_pos_embed(table, (4, 4), num_prefix_tokens=2), table)
    out = resample_pos_embed(table, (2, 3), num_prefix_tokens=2)
    assert out.shape == (1, 2 + 6, 6) and torch.equal(out[:, :2], table[:, :2])
    no_prefix = resample_pos_embed(_table(0, 4, 4), (5, 5), num_prefix_tokens=0)
    assert no_prefix.shape == (1, 25, 6)


def test_resample_errors_name_the_sizes():
    with pytest.raises(ValueError, match="not a square"):
        resample_pos_embed(_table(1, 3, 5), (4, 4))
    with pytest.raises(ValueError, match=r"\(4, 4\)"):
        resample_pos_embed(_table(1, 3, 5), (4, 4), (4, 4))


def test_learned_embedding_adds_rows_from_offset():
    emb = LearnedPositionalEmbedding(10, 4)
    assert isinstance(emb.weight, torch.nn.Parameter)
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(emb(x), x + emb.weight[:3])
    torch.testing.assert_close(emb(x, offset=7), x + emb.weight[7:10])
    with pytest.raises(ValueError, match="11 positions exceeds the table's 10"):
        emb(x, offset=8)


def test_sinusoidal_encoding_adds_sincos_1d_from_offset():
    enc = SinusoidalPositionalEncoding(12, 8)
    assert list(enc.parameters()) == [] and "pe" not in enc.state_dict()  # a non-persistent buffer
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(enc(x), x + sincos_1d(12, 8)[:5])
    torch.testing.assert_close(enc(x, offset=4), x + sincos_1d(12, 8)[4:9])
    assert enc(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="max_positions=12"):
        enc(x, offset=8)

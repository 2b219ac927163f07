"""The analyses against numbers worked out by hand or by brute force."""

import itertools
import math

import numpy as np
import pytest
import torch

from vitscope import create_model
from vitscope.inspect import (
    TokenLayout,
    ablation_importance,
    cls_maps,
    entropy,
    evaluate,
    grad_rollout,
    gradient_importance,
    mean_distance,
    pruning_curve,
    rank_heads,
    region_mass,
    rollout,
    rollout_map,
)

A1 = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.8, 0.1], [0.25, 0.25, 0.5]])


def test_rollout_one_layer_by_hand():
    # (A + I), rows re-normalised: every row of A sums to 1, so this is (A + I) / 2
    want = torch.tensor([[0.75, 0.15, 0.10], [0.05, 0.90, 0.05], [0.125, 0.125, 0.75]])
    got = rollout([A1[None, None]])
    assert got.shape == (1, 3, 3)
    torch.testing.assert_close(got[0], want)


def test_rollout_two_layers_by_hand():
    uniform = torch.full((3, 3), 1 / 3)
    got = rollout([A1[None, None], uniform[None, None]])[0]
    # layer 2 gives rows (2/3, 1/6, 1/6) etc.; row 0 of M2 @ M1 worked out term by term:
    row0 = [2 / 3 * 0.75 + 1 / 6 * 0.05 + 1 / 6 * 0.125,
            2 / 3 * 0.15 + 1 / 6 * 0.90 + 1 / 6 * 0.125,
            2 / 3 * 0.10 + 1 / 6 * 0.05 + 1 / 6 * 0.75]
    torch.testing.assert_close(got[0], torch.tensor(row0))
    assert row0 == pytest.approx([0.5291667, 0.2708333, 0.2], abs=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(3))


def test_rollout_head_fusion_and_discard():
    other = torch.tensor([[0.1, 0.1, 0.8], [0.6, 0.2, 0.2], [0.3, 0.3, 0.4]])
    two_heads = torch.stack([A1, other])[None]  # (1, 2, 3, 3)
    for fusion, fused in [("mean", (A1 + other) / 2), ("max", torch.maximum(A1, other)),
                          ("min", torch.minimum(A1, other))]:
        a = fused + torch.eye(3)
        torch.testing.assert_close(rollout([two_heads], head_fusion=fusion)[0], a / a.sum(-1, keepdim=True))
    # one prefix token (column 0, never discarded); 2 patch columns, ratio 0.5 drops the lower one per row
    got = rollout([A1[None, None]], discard_ratio=0.5, num_prefix_tokens=1)[0]
    torch.testing.assert_close(got[0], torch.tensor([1.5, 0.3, 0.0]) / 1.8)
    torch.testing.assert_close(got[1], torch.tensor([0.1, 1.8, 0.0]) / 1.9)  # tie: one of the 0.1s goes
    with pytest.raises(ValueError, match="head_fusion"):
        rollout([two_heads], head_fusion="median")


def _layout(p=1, grid=(3, 4), patch=5):
    return TokenLayout(p, grid, patch, (grid[0] * patch, grid[1] * patch))


def _random_weights(b, h, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, n, generator=g).softmax(-1)


def test_cls_and_rollout_maps_on_non_square_grid_with_two_prefix_tokens():
    lay = _layout(p=2, grid=(3, 4))
    w = _random_weights(2, 3, lay.num_tokens)
    maps = cls_maps(w, lay)
    assert maps.shape == (2, 3, 3, 4)
    # patches come after the prefix tokens, in row-major order
    torch.testing.assert_close(maps[1, 2, 1, 3], w[1, 2, 0, 2 + 1 * 4 + 3])
    r = rollout([w, w], num_prefix_tokens=2)
    assert rollout_map(r, lay).shape == (2, 3, 4)
    no_prefix = _layout(p=0, grid=(2, 5))
    w0 = _random_weights(1, 2, 10)
    torch.testing.assert_close(cls_maps(w0, no_prefix), w0.mean(-2).reshape(1, 2, 2, 5))
    with pytest.raises(ValueError, match="expected self-attention weights"):
        cls_maps(w0, lay)


def test_mean_distance_self_attention_is_zero():
    lay = _layout(p=1, grid=(3, 4))
    w = torch.eye(lay.num_tokens).expand(2, 3, -1, -1)
    torch.testing.assert_close(mean_distance(w, lay), torch.zeros(3))


@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_mean_distance_uniform_is_mean_pairwise_distance(prefix):
    gh, gw, patch = 3, 4, 5
    lay = _layout(p=prefix, grid=(gh, gw), patch=patch)
    n = lay.num_tokens
    # uniform over every token, prefix ones included: re-normalised over patches it is uniform there
    w = torch.full((2, 2, n, n), 1.0 / n)
    cells = list(itertools.product(range(gh), range(gw)))
    brute = sum(math.hypot(a[0] - b[0], a[1] - b[1]) * patch for a in cells for b in cells) / len(cells) ** 2
    torch.testing.assert_close(mean_distance(w, lay), torch.full((2,), brute, dtype=torch.float32))


def test_mean_distance_neighbour_attention():
    lay = _layout(p=0, grid=(1, 3), patch=16)
    w = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.0, 1.0, 0.0]])[None, None]
    torch.testing.assert_close(mean_distance(w, lay), torch.tensor([16.0]))


def test_four_regions_sum_to_one_per_row_set():
    lay = _layout(p=2, grid=(2, 3))
    w = _random_weights(3, 4, lay.num_tokens)
    r = region_mass(w, 2)
    assert r.shape == (4, 4)
    torch.testing.assert_close(r[:, 0] + r[:, 1], torch.ones(4))
    torch.testing.assert_close(r[:, 2] + r[:, 3], torch.ones(4))
    # CLS→CLS of head 1 by hand: the prefix rows' mass on prefix columns, averaged over rows and batch
    torch.testing.assert_close(r[1, 0], w[:, 1, :2, :2].sum(-1).mean())
    r0 = region_mass(_random_weights(1, 2, 6), 0)
    assert torch.isnan(r0[:, :2]).all() and torch.allclose(r0[:, 3], torch.ones(2))


def test_entropy():
    n = 7
    w = torch.stack([torch.eye(n), torch.full((n, n), 1 / n)])[None]  # head 0 one-hot, head 1 uniform
    torch.testing.assert_close(entropy(w), torch.tensor([0.0, math.log(n)]))


def _tiny(seed=0):
    torch.manual_seed(seed)
    return create_model("vit_tiny_patch4_28", depth=2, embed_dim=32, num_heads=4, img_size=(12, 20)).eval()


def _data(m=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, 1, 12, 20, generator=g), torch.randint(0, 10, (m,), generator=g)


def test_grad_rollout_is_identity_plus_positive_relevance():
    model = _tiny()
    x, _ = _data(3)
    r = grad_rollout(model, x)
    assert r.shape == (3, 1 + 15, 1 + 15)
    assert (r >= 0).all() and torch.all(torch.diagonal(r, dim1=-2, dim2=-1) >= 1)
    assert not torch.allclose(grad_rollout(model, x, target=2), grad_rollout(model, x, target=7))
    assert all(b.attn.capture is None for b in model.blocks) and not model.training


def test_ablating_a_head_with_zero_output_projection_changes_nothing():
    model = _tiny()
    with torch.no_grad():
        model.blocks[1].attn.proj.weight[:, 2 * 8:3 * 8] = 0.0  # head 2's input columns of the projection
    data = _data()
    imp = ablation_importance(model, data, batch_size=10)
    assert imp.delta_loss.shape == (2, 4)
    assert abs(imp.delta_loss[1, 2]) < 1e-6 and imp.delta_accuracy[1, 2] == 0.0
    assert np.abs(imp.delta_loss).max() > 1e-4  # other heads do matter
    assert (imp.base_loss, imp.base_accuracy) == pytest.approx(evaluate(model, data))
    assert all(b.attn.head_mask is None for b in model.blocks)
    grad = gradient_importance(model, data)
    assert grad.score[1, 2] == pytest.approx(0.0, abs=1e-9)


def test_gradient_importance_matches_finite_differences():
    model = _tiny().double()
    x, y = _data(8)
    grad = gradient_importance(model, (x.double(), y), batch_size=8)
    attn, eps = model.blocks[0].attn, 1e-5

    def loss_with(xi1):
        mask = torch.ones(4, dtype=torch.float64)
        mask[1] = xi1
        attn.head_mask = mask
        try:
            with torch.no_grad():
                return torch.nn.functional.cross_entropy(model(x.double()), y).item()
        finally:
            attn.head_mask = None

    fd = abs(loss_with(1 + eps) - loss_with(1 - eps)) / (2 * eps)
    assert grad.score[0, 1] == pytest.approx(fd, rel=1e-4)


def test_ranking_and_pruning_curve():
    score = np.array([[0.1, 0.5, 0.0, 0.9], [0.3, -0.2, 0.4, 0.05]])
    assert rank_heads(score) == [(0, 3), (0, 1), (1, 2), (1, 0), (0, 0), (1, 3), (0, 2), (1, 1)]
    model = _tiny()
    data = _data(16)
    curve = pruning_curve(model, data, score)
    assert curve.order == rank_heads(score)[::-1] and curve.removed == list(range(9))
    assert curve.accuracy[0] == evaluate(model, data)[1]
    for b in model.blocks:
        b.attn.head_mask = torch.zeros(4)
    none_left = evaluate(model, data)
    assert curve.accuracy[-1] == none_left[1] and curve.loss[-1] == pytest.approx(none_left[0])
    for b in model.blocks:
        b.attn.head_mask = None
    assert pruning_curve(model, data, score, steps=2).removed == [0, 4, 8]
    with pytest.raises(ValueError, match="scores for 2 x 2 heads"):
        pruning_curve(model, data, score[:, :2])

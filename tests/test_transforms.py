"""Batch augmentation: shapes, determinism under an explicit generator, what each op does, and
the policy ops against PIL.ImageOps (a reference these ops were not written from)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from vitscope.data import TrainTransform, eval_transform, mix, normalize
from vitscope.data.mixing import cutmix, mixup
from vitscope.data.policy import NUM_BINS, apply_ops, op_names, rand_augment, trivial_augment
from vitscope.data.transforms import (
    random_crop,
    random_erase,
    random_hflip,
    random_resized_crop,
    shift,
    tta_views,
)

MEAN, STD = (0.286,), (0.353,)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def batch() -> torch.Tensor:
    return torch.randint(0, 256, (16, 1, 12, 12), generator=gen(123), dtype=torch.uint8)


def test_normalize_and_eval_transform(batch):
    out = eval_transform(batch, MEAN, STD)
    assert out.dtype == torch.float32 and out.shape == batch.shape
    expected = (batch.double() / 255 - MEAN[0]) / STD[0]
    assert torch.allclose(out.double(), expected, atol=1e-5)
    assert torch.allclose(normalize(batch.float() / 255, MEAN, STD), out)
    with pytest.raises(ValueError, match="need 1 values"):
        normalize(batch, (0.5, 0.5, 0.5), (0.2, 0.2, 0.2))


@pytest.mark.parametrize(
    "config",
    [
        dict(crop="pad", flip=True),
        dict(crop="pad", pad_mode="zero", policy="trivial", erase_p=0.5),
        dict(crop="rrc", policy="randaug", flip=False),
        dict(crop="none", policy="trivial"),
    ],
)
@pytest.mark.parametrize("channels", [1, 3])
def test_train_transform_is_deterministic_under_its_generator(config, channels):
    x = torch.randint(0, 256, (8, channels, 12, 12), generator=gen(5), dtype=torch.uint8)
    tf = TrainTransform(**config, mean=(0.5,) * channels, std=(0.25,) * channels)
    global_state = torch.random.get_rng_state()
    a, b, c = tf(x, gen(1)), tf(x, gen(1)), tf(x, gen(2))
    assert torch.equal(torch.random.get_rng_state(), global_state)  # the global RNG is never used
    assert a.dtype == torch.float32 and a.shape == x.shape
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.isfinite(a).all()


def test_train_transform_config_checks():
    with pytest.raises(ValueError, match="policy must be one of"):
        TrainTransform(policy="autoaugment")
    with pytest.raises(ValueError, match="mean/std"):
        TrainTransform()(torch.zeros(1, 1, 4, 4, dtype=torch.uint8), gen())


def test_flip_flips(batch):
    assert torch.equal(random_hflip(batch, gen(), p=1.0), batch.flip(-1))
    assert torch.equal(random_hflip(batch, gen(), p=0.0), batch)
    half = random_hflip(batch, gen(), p=0.5)
    flipped = [torch.equal(half[i], batch[i].flip(-1)) for i in range(len(batch))]
    assert any(flipped) and not all(flipped)


@pytest.mark.parametrize("mode", ["reflect", "zero"])
def test_crop_keeps_a_window_of_the_padded_image(batch, mode):
    pad = 3
    out = random_crop(batch, pad, gen(), mode=mode)
    assert out.dtype == torch.uint8 and out.shape == batch.shape
    padded = F.pad(batch.float(), (pad,) * 4, mode="reflect" if mode == "reflect" else "constant")
    offsets = set()
    for i in range(len(batch)):
        hits = [
            (dy, dx)
            for dy, dx in itertools.product(range(2 * pad + 1), repeat=2)
            if torch.equal(out[i].float(), padded[i, :, dy : dy + 12, dx : dx + 12])
        ]
        assert hits, f"image {i} is not a window of its padded image"
        offsets.add(hits[0])
    assert len(offsets) > 3  # offsets vary per image


@pytest.mark.parametrize("dx,dy", [(1, 0), (-1, 0), (0, 2), (0, -2), (3, -1)])
def test_shift_is_a_window_of_the_reflect_padded_image(batch, dx, dy):
    pad = 3
    padded = F.pad(batch.float(), (pad,) * 4, mode="reflect")  # torch's own reflect padding
    want = padded[..., pad - dy : pad - dy + 12, pad - dx : pad - dx + 12]
    out = shift(batch, dx, dy)
    assert out.dtype == torch.uint8 and torch.equal(out.float(), want)
    assert torch.equal(out[..., max(dy, 0) : 12 + min(dy, 0), max(dx, 0) : 12 + min(dx, 0)],
                       batch[..., max(-dy, 0) : 12 - max(dy, 0), max(-dx, 0) : 12 - max(dx, 0)])  # content moved
    with pytest.raises(ValueError, match="smaller than the image side"):
        shift(batch, 12, 0)


def test_tta_views():
    x = torch.arange(2 * 5 * 5, dtype=torch.float32).view(2, 1, 5, 5)
    assert [len(list(tta_views(x, flip=f, shift_px=s))) for f in (False, True) for s in (0, 1)] == [1, 5, 2, 10]
    views = list(tta_views(x, flip=True, shift_px=1))
    assert torch.equal(views[0], x) and torch.equal(views[1], x.flip(-1))
    assert torch.equal(views[2], shift(x, 1, 0)) and torch.equal(views[3], shift(x, 1, 0).flip(-1))
    moved = {tuple(v.flatten().tolist()) for v in views[2::2]}
    assert moved == {tuple(shift(x, dx, dy).flatten().tolist()) for dx, dy in [(1, 0), (-1, 0), (0, 1), (0, -1)]}


def test_random_resized_crop(batch):
    whole = random_resized_crop(batch, gen(), scale=(1.0, 1.0), ratio=(1.0, 1.0))
    assert torch.allclose(whole, batch.float() / 255, atol=1e-5)  # the full box is the identity
    out = random_resized_crop(batch, gen(), scale=(0.2, 0.5), size=20)
    assert out.shape == (16, 1, 20, 20) and out.min() >= 0 and out.max() <= 1
    assert not torch.allclose(out, F.interpolate(batch.float() / 255, size=20, mode="bilinear"))


def test_random_erase(batch):
    x = normalize(batch, MEAN, STD)
    assert torch.equal(random_erase(x, gen(), p=0.0), x)
    out = random_erase(x, gen(), p=1.0)
    erased = (out == 0) & (x != 0)
    per_image = erased.flatten(1).sum(1)
    assert (per_image > 0).all() and (per_image < 12 * 12).all()


def test_mixup_and_cutmix_give_soft_targets():
    x = torch.rand(8, 1, 10, 10, generator=gen(3))
    y = torch.arange(8) % 4
    for fn in (mixup, cutmix):
        out, soft = fn(x, y, 4, gen(), alpha=1.0)
        assert out.shape == x.shape and soft.shape == (8, 4)
        assert torch.allclose(soft.sum(1), torch.ones(8)) and (soft >= 0).all()
        assert torch.equal(fn(x, y, 4, gen(), alpha=1.0)[1], soft)
    # cutmix: the weight of each image's own label is the share of its pixels it keeps
    out, soft = cutmix(x, y, 4, gen(), alpha=1.0)
    kept = (out == x).flatten(1).float().mean(1)
    own = soft[torch.arange(8), y]
    assert torch.allclose(own[own < 1], kept[own < 1], atol=1e-6)
    _, smoothed = mix(x, y, 4, gen(), smoothing=0.1)  # no mixing: smoothed one-hot targets
    assert torch.allclose(smoothed.sum(1), torch.ones(8)) and torch.allclose(
        smoothed.max(1).values, torch.full((8,), 0.925)
    )
    tf = TrainTransform(mixup_alpha=0.8, cutmix_alpha=1.0)
    assert tf.mix(x, y, 4, gen())[1].shape == (8, 4)


def test_policies_are_batched_and_deterministic():
    x = torch.rand(32, 1, 14, 14, generator=gen(9))
    for policy in (trivial_augment, rand_augment):
        a, b = policy(x, gen(4)), policy(x, gen(4))
        assert torch.equal(a, b) and a.shape == x.shape and a.min() >= 0 and a.max() <= 1
        changed = (a != x).flatten(1).any(1)
        assert 0 < changed.sum() < 32 or policy is rand_augment
    assert "color" in op_names(3) and "color" not in op_names(1)


def ops_for(name: str, b: int) -> torch.Tensor:
    return torch.full((b,), op_names(1).index(name))


@pytest.mark.parametrize(
    "name, bins, pil",
    [
        ("equalize", [0], lambda im, m: ImageOps.equalize(im)),
        ("autocontrast", [0], lambda im, m: ImageOps.autocontrast(im)),
        ("posterize", [0, 15, 30], lambda im, m: ImageOps.posterize(im, 8 - round(m * 4))),
        ("solarize", [0, 10, 30], lambda im, m: ImageOps.solarize(im, round(255 * (1 - m)))),
    ],
)
def test_policy_ops_match_pil(name, bins, pil):
    rng = np.random.default_rng(0)
    pixels = rng.integers(
        30, 200, (len(bins), 12, 12), np.uint8
    )  # a narrow range, so equalize and autocontrast act
    x = torch.from_numpy(pixels).float().unsqueeze(1) / 255
    magnitude = torch.tensor(bins, dtype=torch.float32) / (NUM_BINS - 1)
    out = apply_ops(x, ops_for(name, len(bins)), magnitude, torch.ones(len(bins)))
    ours = (out[:, 0] * 255).round().to(torch.uint8).numpy()
    for i, m in enumerate(magnitude.tolist()):
        reference = np.asarray(pil(Image.fromarray(pixels[i]), m))
        assert np.abs(ours[i].astype(int) - reference).max() <= 1, f"{name} at magnitude {m}"


def test_geometric_ops_move_content():
    x = torch.zeros(4, 1, 15, 15)
    x[:, :, 7, 2:13] = 1.0  # a horizontal bar through the centre
    names = ["rotate", "translate_x", "translate_y", "shear_y"]
    idx = torch.tensor([op_names(1).index(n) for n in names])
    out = apply_ops(x, idx, torch.ones(4), torch.ones(4))
    assert not torch.allclose(out[0], x[0]) and out[0, 0, 7, 7] > 0.9  # rotated about the centre
    shifted = out[1, 0].sum(0).nonzero()
    assert shifted.min() > 2  # moved right by ~45% of the side
    assert out[2, 0, 7].sum() < 0.1  # the bar left its row
    same = apply_ops(x, torch.zeros(4, dtype=torch.long), torch.ones(4), torch.ones(4))
    assert torch.equal(same, x)  # identity

"""Fashion-MNIST scenes: deterministic, recorded cells match the pixels, captions parse back."""

import numpy as np
import pytest
import torch

from vitscope.caption.scenes import (
    CLASS_WORDS,
    ITEM,
    Scene,
    ScenesConfig,
    cell_names,
    exact_match,
    item_accuracy,
    item_word_targets,
    make_scenes,
    parse_caption,
    scenes_checksum,
)
from vitscope.sequence.vocab import tokenize


def _source(n=40, seed=0):
    """Stand-in items: random non-zero textures (never all black) with labels 0..9."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(1, 256, (n, 1, ITEM, ITEM), generator=g, dtype=torch.uint8)
    labels = torch.arange(n) % 10
    return images, labels


@pytest.mark.parametrize("cells", [2, 3])
def test_generator_is_deterministic(cells):
    images, labels = _source()
    cfg = ScenesConfig(cells=cells, seed=3)
    a = make_scenes(images, labels, 25, config=cfg, split="train")
    b = make_scenes(images, labels, 25, config=cfg, split="train")
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
    assert scenes_checksum(*a) == scenes_checksum(*b)
    other = make_scenes(images, labels, 25, config=ScenesConfig(cells=cells, seed=4), split="train")
    assert scenes_checksum(*other) != scenes_checksum(*a)
    test_split = make_scenes(images, labels, 25, config=cfg, split="test")
    assert scenes_checksum(*test_split) != scenes_checksum(*a)


@pytest.mark.parametrize("cells", [2, 3])
def test_recorded_cells_match_the_pixels(cells):
    images, labels = _source()
    canvases, scenes, _ = make_scenes(images, labels, 30, config=ScenesConfig(cells=cells), split="train")
    assert canvases.dtype == torch.uint8 and canvases.shape == (30, 1, cells * ITEM, cells * ITEM)
    for canvas, scene in zip(canvases, scenes):
        assert 1 <= len(scene.items) <= 4 and len(scene.sources) == len(scene.items)
        filled = {cell for cell, _ in scene.items}
        for cell in range(cells * cells):
            r, c = divmod(cell, cells)
            patch = canvas[0, r * ITEM:(r + 1) * ITEM, c * ITEM:(c + 1) * ITEM]
            if cell in filled:
                (cls, src), = [(k, s) for (ce, k), s in zip(scene.items, scene.sources) if ce == cell]
                assert torch.equal(patch, images[src, 0]) and int(labels[src]) == cls
            else:
                assert int(patch.max()) == 0  # empty cells are black


def test_items_are_not_reused_within_a_pass():
    images, labels = _source(n=40)
    _, scenes, _ = make_scenes(images, labels, 12, config=ScenesConfig(), split="train")
    used = [s for scene in scenes for s in scene.sources][:40]
    assert len(used) == len(set(used))


@pytest.mark.parametrize("cells", [2, 3])
def test_every_reference_parses_back_to_its_scene(cells):
    images, labels = _source()
    _, scenes, captions = make_scenes(images, labels, 60, config=ScenesConfig(cells=cells), split="test")
    for scene, caps in zip(scenes, captions):
        assert len(caps) == 5 and len(set(caps)) == 5  # five distinct phrasings
        for cap in caps:
            assert sorted(parse_caption(cap, cells)) == sorted(scene.items), cap
    words = [tokenize(c[0]) for c in captions]
    assert item_accuracy(words, scenes) == 1.0 and exact_match(words, scenes) == 1.0


def test_phrasings_and_measures_on_a_fixed_scene():
    scene = Scene(cells=2, items=((0, 7), (3, 9)))  # sneaker top left, ankle boot bottom right
    assert parse_caption("top left: sneaker; bottom right: ankle boot", 2) == [(0, 7), (3, 9)]
    assert parse_caption("two items: an ankle boot (bottom right) and a sneaker (top left)", 2) == [(3, 9), (0, 7)]
    wrong_cell = tokenize("a sneaker at the top right and an ankle boot at the bottom right")
    assert item_accuracy([wrong_cell], [scene]) == 0.5 and exact_match([wrong_cell], [scene]) == 0.0
    extra = tokenize("a sneaker at the top left, a bag at the top right and an ankle boot at the bottom right")
    assert item_accuracy([extra], [scene]) == 1.0 and exact_match([extra], [scene]) == 0.0
    # each word of a class name points at its item's cell; the sneaker named at the wrong cell still
    # points at the scene's only sneaker
    assert item_word_targets(wrong_cell, scene) == [(1, 0), (8, 3), (9, 3)]


def test_names_and_config_checks():
    assert cell_names(2) == ["top left", "top right", "bottom left", "bottom right"]
    assert cell_names(3)[4] == "centre" and cell_names(3)[1] == "top centre"
    assert len(CLASS_WORDS) == 10
    with pytest.raises(ValueError, match="2 x 2 or 3 x 3"):
        ScenesConfig(cells=4)
    with pytest.raises(ValueError, match="max_items"):
        ScenesConfig(cells=2, max_items=5)
    with pytest.raises(ValueError, match="splits"):
        make_scenes(*_source(), 2, split="val")


def test_real_fashion_mnist_scenes_use_their_own_split():
    from vitscope.caption.scenes import load_scenes
    from vitscope.data import DataError, load_dataset

    try:
        test_items = load_dataset("fashion_mnist", "test", download=False)
    except DataError as e:
        pytest.skip(f"Fashion-MNIST files not here ({e})")
    ds = load_scenes("test", config=ScenesConfig(test_size=50), verify=False)
    assert len(ds) == 50 and ds.image_shape == (1, 56, 56)
    for canvas, scene in zip(ds.images[:10], ds.scenes[:10]):
        for (cell, cls), src in zip(scene.items, scene.sources):
            r, c = divmod(cell, 2)
            assert torch.equal(canvas[0, r * 28:(r + 1) * 28, c * 28:(c + 1) * 28], test_items.images[src, 0])
            assert int(test_items.labels[src]) == cls
    assert np.isfinite(ds.mean[0])


def test_default_test_split_matches_its_documented_checksum():
    from vitscope.caption.scenes import CHECKSUMS, load_scenes
    from vitscope.data import DataError, load_dataset

    try:
        load_dataset("fashion_mnist", "test", download=False)
    except DataError as e:
        pytest.skip(f"Fashion-MNIST files not here ({e})")
    ds = load_scenes("test")  # verifies against CHECKSUMS, raising on a mismatch
    assert scenes_checksum(ds.images, ds.scenes, ds.captions) == CHECKSUMS[(2, "test")]
    assert len(ds) == 2000 and ds.image_shape == (1, 56, 56) and all(len(c) == 5 for c in ds.captions)

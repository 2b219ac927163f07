"""Pictures are produced for non-square inputs: every file exists, is a valid PNG and is not blank."""

import json

import numpy as np
import torch
from PIL import Image

from vitscope import create_model
from vitscope.inspect import write_report


def test_write_report_on_non_square_images(tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=2, embed_dim=24, num_heads=3, img_size=(16, 28)).eval()
    images, labels = torch.randn(4, 1, 16, 28), torch.randint(0, 10, (4,))
    names = [f"class {i}" for i in range(10)]
    paths = write_report(model, images, tmp_path, labels=labels, class_names=names, pruning_steps=3)
    names = {p.name for p in paths}
    assert {"overlays.png", "heads_last_layer.png", "heads_all_layers.png", "distance.png", "regions.png",
            "importance.png", "pruning.png", "stats.json"} <= names
    for p in paths:
        assert p.exists() and p.stat().st_size > (5_000 if p.suffix == ".png" else 500), p
        if p.suffix == ".png":
            with Image.open(p) as im:
                im.verify()
            with Image.open(p) as im:
                a = np.asarray(im.convert("L"), dtype=np.float32)
                assert im.width > 200 and im.height > 150 and a.std() > 10, p  # not one flat colour
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["layout"]["grid"] == [4, 7]
    assert np.asarray(stats["stats"]["distance"]).shape == (2, 3)


def test_write_report_without_labels_skips_importance(tmp_path):
    model = create_model("vit_tiny_patch4_28", depth=1, embed_dim=16, num_heads=2, class_token=False,
                         global_pool="avg").eval()
    paths = write_report(model, torch.randn(2, 1, 28, 28), tmp_path)
    names = {p.name for p in paths}
    assert "importance.png" not in names and "overlays.png" in names

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


def _tiny_capture():
    from vitscope.inspect import capture_attention

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=2, embed_dim=24, num_heads=3).eval()
    images = torch.randn(2, 1, 28, 28)
    return images, capture_attention(model, images)


def test_plots_return_figures_that_hold_the_numbers(tmp_path):
    """The pictures are figures, not files: what each axes shows is the attention it is named after."""
    from vitscope.figures import Figure
    from vitscope.inspect import cls_maps, head_stats
    from vitscope.inspect.plots import plot_distance, plot_heads_grid, plot_regions
    from vitscope.inspect.stats import REGIONS

    images, cap = _tiny_capture()
    fig = plot_heads_grid(images[1], cap, image_index=1)
    assert isinstance(fig, Figure) and not list(tmp_path.iterdir())  # nothing written without a path
    axes = np.asarray(fig.axes).reshape(2, 3)  # (layers, heads)
    for layer in range(2):
        maps = cls_maps(cap[layer], cap.layout)[1]  # (H, 7, 7)
        for h in range(3):
            image, amap = axes[layer, h].get_images()
            np.testing.assert_allclose(amap.get_array(), maps[h].numpy(), atol=1e-6)
    assert [ax.get_title() for ax in axes[0]] == ["head 0", "head 1", "head 2"]

    stats = head_stats(cap)
    fig = plot_regions(stats)
    for ax, name in zip(fig.axes, REGIONS):
        np.testing.assert_allclose(ax.get_images()[0].get_array(), stats.region(name), atol=1e-6)

    fig = plot_distance(stats)
    ys = np.stack([c.get_offsets()[:, 1] for c in fig.axes[0].collections], 1)  # (layers, heads)
    np.testing.assert_allclose(ys, stats.distance, atol=1e-6)


def test_a_path_writes_the_figure_as_png(tmp_path):
    from vitscope.inspect.plots import plot_overlays

    images, cap = _tiny_capture()
    fig = plot_overlays(images, cap, tmp_path / "sub" / "overlays.png")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["overlays.png"]  # no temporary file left
    with Image.open(tmp_path / "sub" / "overlays.png") as im:
        assert im.format == "PNG" and im.width > 200
    png = fig._repr_png_()  # what a notebook shows where pyplot was never imported
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5_000


def test_importing_the_pictures_leaves_the_backend_alone():
    """A notebook's inline backend survives `import vitscope.inspect.plots` (and the other drawing modules)."""
    import os
    import subprocess
    import sys

    code = ("import sys, matplotlib\n"
            "import vitscope.inspect.plots, vitscope.caption.plots, vitscope.training.curves, vitscope.figures\n"
            "from vitscope.inspect import write_report, explore\n"
            "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n")
    env = {**os.environ, "MPLBACKEND": "pdf", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pdf", "False"]

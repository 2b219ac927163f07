"""`vitscope explain`: a checkpoint or run directory and image files in, pictures and explorer.html out."""

import argparse

import numpy as np
import pytest
import torch
from PIL import Image

from vitscope import create_model
from vitscope.cli.explain import add_explain_parser, run_explain
from vitscope.weights.model_io import save_model


def _parse(argv):
    parser = argparse.ArgumentParser(prog="vitscope")
    add_explain_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["explain", *argv])


@pytest.fixture
def run_dir(tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", depth=1, embed_dim=16, num_heads=2, img_size=(12, 20))
    run = tmp_path / "run"
    run.mkdir()
    save_model(model, run / "last.safetensors", metadata={"classes": [f"c{i}" for i in range(10)],
                                                          "mean": [0.5], "std": [0.25]})
    return run


def test_explain_run_directory_with_image_files(run_dir, tmp_path, capsys):
    rgb = tmp_path / "photo.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(rgb)
    gray = tmp_path / "gray.png"
    Image.fromarray(np.zeros((12, 20), np.uint8)).save(gray)
    out = tmp_path / "out"
    assert run_explain(_parse([str(run_dir), str(rgb), str(gray), "--out", str(out)])) == 0
    printed = capsys.readouterr().out.split()
    assert str(out / "explorer.html") in printed and str(out / "overlays.png") in printed
    page = (out / "explorer.html").read_text()
    assert "photo.jpg" in page and '"c' in page  # image names and class names reach the page
    assert (out / "distance.png").stat().st_size > 5_000
    assert {p.name for p in out.iterdir()} == {"explorer.html", "overlays.png", "heads_last_layer.png",
                                               "heads_all_layers.png", "distance.png", "regions.png", "stats.json"}
    for p in out.glob("*.png"):
        with Image.open(p) as im:
            assert im.format == "PNG" and im.width > 200, p
            im.verify()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")


def test_explain_errors_are_one_line_with_exit_code_2(run_dir, tmp_path, capsys):
    assert run_explain(_parse([str(tmp_path / "nowhere"), "x.png", "--out", str(tmp_path / "o")])) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    assert run_explain(_parse([str(run_dir), "--out", str(tmp_path / "o")])) == 2
    assert "give image files, or --dataset" in capsys.readouterr().err
    missing = str(tmp_path / "missing.png")
    assert run_explain(_parse([str(run_dir), missing, "--out", str(tmp_path / "o")])) == 2
    err = capsys.readouterr().err
    assert "no image file at" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert run_explain(_parse([str(tmp_path / "empty"), "x.png", "--out", str(tmp_path / "o")])) == 2
    assert "best.safetensors or last.safetensors" in capsys.readouterr().err

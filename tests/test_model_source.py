"""What eval, predict and explain accept as the model (vitscope.weights.model_source): timm's own checkpoint file and
a preset's pretrained weights behind a file:// hub, besides vitscope's runs (tests/test_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from vitscope.cli import main
from vitscope.models import create_model
from vitscope.weights.model_source import open_model
from vitscope.weights.pretrained import TIMM_WEIGHTS

TIMM_TINY = Path(__file__).parent / "fixtures" / "timm_vit_tiny_patch16_224_depth2.safetensors"


@pytest.fixture
def hub_tiny(tmp_path, monkeypatch):
    """A hub serving a whole (12-block, 1000-class) ViT-Ti/16 under timm's names, as huggingface.co does."""
    root = tmp_path / "hub"
    file = root / "timm" / TIMM_WEIGHTS["vit_tiny_patch16_224"] / "resolve" / "main" / "model.safetensors"
    file.parent.mkdir(parents=True)
    torch.manual_seed(3)
    sd = {k: v.contiguous() for k, v in create_model("vit_tiny_patch16_224").state_dict().items()}
    save_file(sd, str(file))
    monkeypatch.setenv("HF_ENDPOINT", root.as_uri())
    monkeypatch.setenv("VITSCOPE_DATA", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return sd


def test_a_timm_file_opens_with_its_head_count_from_its_metadata():
    fx = load_file(TIMM_TINY)
    model, info = open_model(TIMM_TINY)
    assert model.config.num_heads == 3 and model.config.depth == 2
    with torch.no_grad():
        torch.testing.assert_close(model(fx["input"]), fx["logits"], rtol=0, atol=1e-4)
    assert info.classes == [str(i) for i in range(100)] and not info.named_classes
    assert info.mean == (0.5,) * 3 and not info.normalisation_known


def test_a_timm_file_without_metadata_takes_the_heads_of_the_preset_of_its_shape(hub_tiny, tmp_path):
    bare = tmp_path / "bare.safetensors"
    save_file(hub_tiny, str(bare))  # no metadata at all: ViT-Ti/16's width and depth say 3 heads
    model, _ = open_model(bare)
    assert model.config.num_heads == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in hub_tiny.items())


def test_a_preset_name_opens_its_pretrained_weights(hub_tiny):
    model, info = open_model("vit_tiny_patch16_224")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in hub_tiny.items())
    assert info.mean == (0.5,) * 3 and info.normalisation_known and len(info.classes) == 1000
    with pytest.raises(FileNotFoundError, match="the preset vit_fmnist_quick has no pretrained weights"):
        open_model("vit_fmnist_quick")
    with pytest.raises(FileNotFoundError, match="no checkpoint at no_such_run"):
        open_model("no_such_run")


def test_predict_and_explain_a_pretrained_preset_from_the_command_line(hub_tiny, tmp_path, capsys):
    img = tmp_path / "cat.png"
    Image.fromarray((torch.rand(64, 48, 3) * 255).byte().numpy()).save(img)
    assert main(["predict", "vit_tiny_patch16_224", str(img), "--json", "--top-k", "2"]) == 0
    top = json.loads(capsys.readouterr().out)[0]["top"]
    model, info = open_model("vit_tiny_patch16_224")
    from vitscope.data.image_files import load_image_files
    from vitscope.data.transforms import eval_transform

    x = eval_transform(load_image_files([img], channels=3, size=(224, 224)), info.mean, info.std)
    with torch.no_grad():
        want = model(x).softmax(-1)[0].topk(2)
    assert [t["label"] for t in top] == [str(i) for i in want.indices.tolist()]
    assert main(["explain", "vit_tiny_patch16_224", str(img), "--out", str(tmp_path / "ex"), "--no-report"]) == 0
    assert (tmp_path / "ex" / "explorer.html").stat().st_size > 10_000
    assert "warning" not in capsys.readouterr().err  # the weights' own normalisation is known


def test_eval_refuses_data_with_another_number_of_classes(capsys):
    assert main(["eval", str(TIMM_TINY), "--dataset", "digits"]) == 2
    assert "the model has 100 outputs but digits has 10 classes" in capsys.readouterr().err

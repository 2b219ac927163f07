"""Pretrained weights (vitscope.weights.pretrained): fetched from a hub laid out as huggingface.co serves timm's
files, here a folder behind a file:// HF_ENDPOINT, holding the checkpoint timm wrote (tests/fixtures)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitscope.models import create_model
from vitscope.weights.pretrained import TIMM_WEIGHTS, WeightsError, adapt_input_channels, weights_file, weights_url

TIMM_TINY = Path(__file__).parent / "fixtures" / "timm_vit_tiny_patch16_224_depth2.safetensors"
SHAPE = {"depth": 2, "num_classes": 100}  # the fixture's ViT-Ti/16 is two blocks deep with 100 classes


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A hub with timm's ViT-Ti/16 checkpoint where huggingface.co keeps vit_tiny_patch16_224's, and an
    empty cache."""
    root = tmp_path / "hub"
    file = root / "timm" / TIMM_WEIGHTS["vit_tiny_patch16_224"] / "resolve" / "main" / "model.safetensors"
    file.parent.mkdir(parents=True)
    shutil.copy(TIMM_TINY, file)
    monkeypatch.setenv("HF_ENDPOINT", root.as_uri())
    monkeypatch.setenv("VITSCOPE_DATA", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return file


def test_the_url_is_the_hubs_and_follows_hf_endpoint(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert weights_url("vit_small_patch16_224") == (
        "https://huggingface.co/timm/vit_small_patch16_224.augreg_in21k_ft_in1k/resolve/main/model.safetensors")
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.example/")
    assert weights_url("vit_base_patch16_224").startswith("https://mirror.example/timm/vit_base_patch16_224.")


def test_pretrained_downloads_once_and_gives_timms_outputs(hub, tmp_path):
    fx = load_file(TIMM_TINY)
    model = create_model("vit_tiny_patch16_224", pretrained=True, **SHAPE).eval()
    cached = tmp_path / "cache" / "weights" / f"{TIMM_WEIGHTS['vit_tiny_patch16_224']}.safetensors"
    assert cached.read_bytes() == TIMM_TINY.read_bytes()
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no partial file left beside it
    with torch.no_grad():
        torch.testing.assert_close(model(fx["input"]), fx["logits"], rtol=0, atol=1e-4)
    hub.unlink()  # the second model comes from the cache
    again = create_model("vit_tiny_patch16_224", pretrained=True, **SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_another_head_channels_and_size_are_adapted_as_timm_does(hub):
    fx = load_file(TIMM_TINY)
    x = fx["input"]
    rgb = create_model("vit_tiny_patch16_224", pretrained=True, **SHAPE).eval()
    with torch.no_grad():
        ten = create_model("vit_tiny_patch16_224", pretrained=True, depth=2, num_classes=10).eval()
        torch.testing.assert_close(ten.forward_features(x), fx["features"], rtol=0, atol=1e-4)
        assert ten.head.weight.shape == (10, 192)
        no_head = create_model("vit_tiny_patch16_224", pretrained=True, depth=2, num_classes=0).eval()
        torch.testing.assert_close(no_head(x), fx["pre_logits"], rtol=0, atol=1e-4)
        grey = x.mean(1, keepdim=True)  # a grey image: the one-channel model sees what RGB sees for it
        one = create_model("vit_tiny_patch16_224", pretrained=True, in_chans=1, **SHAPE).eval()
        torch.testing.assert_close(one(grey), rgb(grey.expand(-1, 3, -1, -1)), rtol=0, atol=1e-4)
        six = create_model("vit_tiny_patch16_224", pretrained=True, in_chans=6, **SHAPE).eval()
        torch.testing.assert_close(six(torch.cat([x, x], 1)), rgb(x), rtol=0, atol=1e-4)
        small = create_model("vit_tiny_patch16_224", pretrained=True, img_size=112, **SHAPE).eval()
        assert small.pos_embed.shape == (1, 1 + 7 * 7, 192) and small(x[:, :, :112, :112]).shape == (2, 100)


def test_adapt_input_channels_keeps_rgb_as_is():
    w = torch.randn(4, 3, 2, 2)
    assert adapt_input_channels(w, 3) is w
    torch.testing.assert_close(adapt_input_channels(w, 2), w[:, :2] * 1.5)


def test_a_checkpoint_of_another_shape_is_refused_by_name(hub):
    with pytest.raises(ValueError, match="does not fit the model"):
        create_model("vit_tiny_patch16_224", pretrained=True, num_classes=100)  # 12 blocks, the file has 2


def test_offline_unreachable_and_wrong_answers_keep_nothing(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError, match="HF_HUB_OFFLINE is set"):
        weights_file("vit_tiny_patch16_224", progress=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", (tmp_path / "nowhere").as_uri())
    with pytest.raises(WeightsError, match="could not download .*put it at .*pretrained=PATH"):
        weights_file("vit_tiny_patch16_224", progress=False)
    hub.write_text("<html>a login page</html>")  # a proxy's answer instead of the file
    monkeypatch.setenv("HF_ENDPOINT", hub.parents[4].as_uri())
    with pytest.raises(WeightsError, match="did not give a safetensors file"):
        weights_file("vit_tiny_patch16_224", progress=False)
    weights = tmp_path / "cache" / "weights"
    assert not weights.exists() or not any(weights.iterdir())
    with pytest.raises(WeightsError, match="no pretrained weights for 'vit_fmnist_quick'"):
        create_model("vit_fmnist_quick", pretrained=True)


def test_pretrained_path_takes_a_local_timm_file():
    fx = load_file(TIMM_TINY)
    model = create_model("vit_tiny_patch16_224", pretrained=TIMM_TINY, **SHAPE).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(fx["input"]), fx["logits"], rtol=0, atol=1e-4)


def test_training_from_pretrained_weights_starts_from_them_and_resumes_offline(hub, tmp_path, monkeypatch):
    """`vitscope train --pretrained true` on 8x8 grey digits scaled to 32x32: the blocks start as timm's,
    the images are normalised as the weights were trained (0.5, 0.5), and a resumed run needs no hub."""
    import json

    from vitscope.data.transforms import TrainTransform
    from vitscope.training.loop import TrainConfig, train
    from vitscope.training.options import ImageOptions
    from vitscope.weights.model_io import read_metadata

    image = ImageOptions(model="vit_tiny_patch16_224", model_args={"depth": 2}, pretrained=True, image_size=32,
                         augment=TrainTransform(crop="none", flip=False))
    cfg = TrainConfig(image=image, dataset="digits", epochs=1, batch_size=64, lr=1e-9, weight_decay=0.0,
                      clip_grad=None, amp="fp32", explain_images=0, threads=1)
    run = tmp_path / "run"
    train(cfg, run, progress=False, max_steps=2)
    timm_sd = {k.removeprefix("model."): v for k, v in load_file(TIMM_TINY).items() if k.startswith("model.")}
    ours = load_file(run / "last.safetensors")
    for key in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.weight", "norm.weight", "cls_token"):
        torch.testing.assert_close(ours[key], timm_sd[key], rtol=0, atol=1e-6)  # two steps at lr 1e-9
    torch.testing.assert_close(ours["patch_embed.proj.weight"],
                               timm_sd["patch_embed.proj.weight"].sum(1, keepdim=True), rtol=0, atol=1e-6)
    assert ours["head.weight"].shape == (10, 192) and ours["pos_embed"].shape == (1, 5, 192)
    meta = read_metadata(run / "last.safetensors")
    assert json.loads(meta["mean"]) == [0.5] and json.loads(meta["std"]) == [0.5]
    assert json.loads((run / "config.json").read_text())["image"]["pretrained"] is True
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert train(cfg, run, resume=True, progress=False).stopped == "finished"


def test_a_conv_stem_checkpoint_starts_a_headless_encoder_of_another_size_and_channels(tmp_path):
    # the caption recipe's start: a 28 x 28 grayscale classifier's weights -> a 56 x 56 encoder without a head
    from safetensors.torch import save_file

    torch.manual_seed(0)
    classifier = create_model("vit_fmnist_quick")
    path = tmp_path / "best.safetensors"
    save_file(classifier.state_dict(), str(path))
    encoder = create_model("vit_fmnist_quick", pretrained=path, num_classes=0, img_size=56)
    own = encoder.state_dict()
    for k, v in classifier.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(own[k], v), k
    # 3 channels: the stem's first conv (not the projection after it) gets the grayscale kernel spread over
    # them, so a gray RGB image gives the grayscale model's features
    rgb = create_model("vit_fmnist_quick", pretrained=path, num_classes=0, in_chans=3).eval()
    x = torch.rand(2, 1, 28, 28)
    classifier.eval()
    torch.testing.assert_close(rgb.forward_features(x.expand(-1, 3, -1, -1)), classifier.forward_features(x),
                               atol=1e-5, rtol=1e-4)

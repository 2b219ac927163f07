"""Our own checkpoint format, atomic writes, shape errors, resume state and timm-format round trips."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from vitscope.positional import resample_pos_embed
from vitscope.vit import VisionTransformer, ViTConfig
from vitscope.weights.model_io import (
    atomic_write,
    check_state_dict,
    config_from_timm_state_dict,
    create_from_timm,
    load_model,
    load_timm_state_dict,
    load_training_state,
    load_weights,
    read_metadata,
    save_model,
    save_training_state,
)

SMALL = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4,
             mlp_ratio=2.0)


def _model(seed: int = 0, **overrides) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(ViTConfig(**{**SMALL, **overrides}))
    with torch.no_grad():  # move every tensor off its init so that a skipped tensor shows up
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.fixture
def images():
    return torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("overrides", [{}, dict(global_pool="avg", class_token=False),
                                       dict(qk_norm=True, init_values=0.1, img_size=(28, 32))])
def test_save_load_round_trip_is_identical(tmp_path, images, overrides):
    model = _model(**overrides)
    x = images if "img_size" not in overrides else torch.randn(3, 1, 28, 32)
    path = save_model(model, tmp_path / "m.safetensors", metadata={"epoch": 3, "note": "hi"})
    loaded = load_model(path)
    assert loaded.config == model.config
    assert not loaded.training
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    meta = read_metadata(path)
    assert meta["epoch"] == "3" and meta["note"] == "hi" and meta["vitscope_format"] == "1"

    fresh = _model(seed=5, **overrides)
    load_weights(fresh, path)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_reserved_metadata_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'config' is reserved"):
        save_model(_model(), tmp_path / "m.safetensors", metadata={"config": "x"})


def test_atomic_write_leaves_no_temp_files_and_keeps_old_file_on_error(tmp_path):
    target = tmp_path / "sub" / "f.bin"
    atomic_write(target, lambda tmp: open(tmp, "wb").write(b"old"))
    assert target.read_bytes() == b"old"
    assert os.listdir(target.parent) == ["f.bin"]

    def crash(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half a new fi")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(target, crash)
    assert target.read_bytes() == b"old"
    assert os.listdir(target.parent) == ["f.bin"]


def test_save_model_crash_keeps_previous_checkpoint(tmp_path, images, monkeypatch):
    model = _model()
    path = save_model(model, tmp_path / "m.safetensors")
    before = path.read_bytes()

    import vitscope.weights.model_io as ck

    def torn_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "save_file", torn_save)
    with pytest.raises(KeyboardInterrupt):
        save_model(_model(seed=1), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_shape_mismatch_names_first_tensor_and_both_shapes(tmp_path):
    path = save_model(_model(), tmp_path / "m.safetensors")
    wider = VisionTransformer(ViTConfig(**{**SMALL, "embed_dim": 96, "num_heads": 4}))
    with pytest.raises(ValueError) as err:
        load_weights(wider, path)
    msg = str(err.value)
    # state-dict order: cls_token is the first tensor whose shape differs
    assert "'cls_token' has shape (1, 1, 64) but the model expects (1, 1, 96)" in msg
    assert "different preset" in msg

    sd = dict(_model().state_dict())
    sd["blocks.1.attn.qkv.weight"] = torch.zeros(192, 32)
    want = r"'blocks\.1\.attn\.qkv\.weight' has shape \(192, 32\) but the model expects \(192, 64\)"
    with pytest.raises(ValueError, match=want):
        check_state_dict(_model(), sd)


def test_missing_and_unknown_keys_are_listed():
    model = _model()
    sd = dict(model.state_dict())
    del sd["head.weight"]
    sd["blocks.9.norm1.weight"] = torch.ones(64)
    with pytest.raises(ValueError) as err:
        load_weights(model, sd)
    msg = str(err.value)
    assert "it lacks 1 tensor(s) the model needs: head.weight" in msg
    assert "1 tensor(s) the model does not know: blocks.9.norm1.weight" in msg


def test_load_model_refuses_foreign_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="no vitscope config"):
        load_model(tmp_path / "x.safetensors")


def test_training_state_round_trip_with_weights_only(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "step": 7, "epoch": 1,
             "data_position": {"epoch": 1, "index": 640}, "tag": "resume"}
    path = save_training_state(tmp_path / "state.pt", state)
    back = load_training_state(path)
    assert back["step"] == 7 and back["tag"] == "resume"
    assert back["data_position"] == {"epoch": 1, "index": 640}
    assert torch.equal(back["rng"], state["rng"])
    opt2 = torch.optim.AdamW(_model(seed=3).parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=0, atol=0)
    assert os.listdir(tmp_path) == ["state.pt"]


def test_a_file_cut_short_says_so_in_one_error(tmp_path):
    """A checkpoint copied or downloaded only in part: a ValueError naming the file, not safetensors' or
    torch's own exception."""
    whole = save_model(_model(), tmp_path / "whole.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    for n in (0, 5, 200, len(whole) // 2):
        cut.write_bytes(whole[:n])
        for load in (load_model, read_metadata, lambda p: load_weights(_model(), p)):
            with pytest.raises(ValueError, match=r"cut\.safetensors cannot be read \(.+\): the file is cut short"):
                load(cut)
    opt = torch.optim.AdamW(_model().parameters())
    state = save_training_state(tmp_path / "state.pt", {"optimizer": opt.state_dict(), "step": 1}).read_bytes()
    (tmp_path / "state.pt").write_bytes(state[: len(state) // 2])
    with pytest.raises(ValueError, match=r"state\.pt cannot be read \(.+\): the file is cut short"):
        load_training_state(tmp_path / "state.pt")
    with pytest.raises(FileNotFoundError, match="gone.pt is missing"):
        load_training_state(tmp_path / "gone.pt")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_training_state_refuses_pickled_code(tmp_path):
    torch.save({"x": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="does not unpickle code"):
        load_training_state(tmp_path / "evil.pt")


# -- timm format ----------------------------------------------------------------------------------
def test_timm_state_dict_round_trip_with_prefix(images):
    model = _model()
    for prefix in ("", "model.", "module."):
        sd = {prefix + k: v for k, v in model.state_dict().items()}
        cfg = config_from_timm_state_dict(sd, num_heads=4)
        assert cfg == model.config
        built = create_from_timm(sd, num_heads=4)
        with torch.no_grad():
            torch.testing.assert_close(built(images), model(images), rtol=0, atol=0)


def test_timm_config_inference_reads_variants():
    sd = _model(global_pool="avg", class_token=False, qk_norm=True, init_values=0.1, qkv_bias=False,
                mlp_ratio=3.0).state_dict()
    cfg = config_from_timm_state_dict(sd)  # qk_norm tells the head count
    assert (cfg.num_heads, cfg.global_pool, cfg.class_token, cfg.qk_norm, cfg.qkv_bias, cfg.mlp_ratio) == \
        (4, "avg", False, True, False, 3.0)
    assert cfg.init_values is not None
    with pytest.raises(ValueError, match="pass num_heads"):
        config_from_timm_state_dict(_model().state_dict())


def test_timm_pos_embed_for_another_grid_is_resampled(images):
    src = _model()  # 7 x 7 grid
    target = VisionTransformer(ViTConfig(**{**SMALL, "img_size": 40}))  # 10 x 10 grid
    load_timm_state_dict(target, src.state_dict())
    expected = resample_pos_embed(src.pos_embed, (10, 10), (7, 7), num_prefix_tokens=1, antialias=True)
    torch.testing.assert_close(target.pos_embed, expected, rtol=0, atol=0)
    torch.testing.assert_close(target.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight)


def test_timm_unknown_keys_error():
    sd = dict(_model().state_dict())
    sd["reg_token"] = torch.zeros(1, 4, 64)
    with pytest.raises(ValueError, match="does not know: reg_token"):
        load_timm_state_dict(_model(), sd)


def test_safetensors_file_holds_plain_timm_names(tmp_path):
    path = save_model(_model(), tmp_path / "m.safetensors")
    keys = set(load_file(path))
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "norm.weight",
            "head.weight"} <= keys


def test_a_torch_file_nested_as_training_scripts_save_it_loads(tmp_path, images):
    model = _model()
    for key in ("state_dict", "model"):
        torch.save({key: model.state_dict(), "epoch": 3}, tmp_path / f"{key}.pt")
        loaded = load_weights(_model(seed=4), tmp_path / f"{key}.pt")
        with torch.no_grad():
            torch.testing.assert_close(loaded(images), model(images), rtol=0, atol=0)


def test_what_a_file_is_when_it_is_not_a_checkpoint(tmp_path):
    from vitscope.weights.files import sniff as _sniff

    (tmp_path / "a.safetensors").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    (tmp_path / "b.safetensors").write_text("weights go here\n")
    (tmp_path / "c.pt").write_bytes(b"PK\x03\x04" + b"\0" * 40)  # a damaged torch file: not "a zip archive"
    whole = save_model(_model(), tmp_path / "d.safetensors").read_bytes()
    (tmp_path / "d.safetensors").write_bytes(whole[:300])
    assert _sniff(tmp_path / "a.safetensors") == "a PNG image"
    assert _sniff(tmp_path / "b.safetensors") == "a text file"
    assert _sniff(tmp_path / "c.pt") is None and _sniff(tmp_path / "d.safetensors") is None  # cut short

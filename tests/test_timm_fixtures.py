"""Checkpoints written by timm itself (tests/fixtures/README.md) reproduce timm's own outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitscope.checkpoints import (
    config_from_timm_state_dict,
    create_from_timm,
    load_timm_state_dict,
    read_metadata,
)
from vitscope.vit import VisionTransformer, ViTConfig

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("timm_*.safetensors"))
ATOL = 1e-5


def test_all_three_fixtures_are_present():
    names = ["timm_vit_28_cls", "timm_vit_28_gap", "timm_vit_tiny_patch16_224_depth2"]
    assert [p.stem for p in FIXTURES] == names


def _fixture(path: Path):
    return json.loads(read_metadata(path)["config"]), load_file(path)


def _assert_reproduces_timm(model: VisionTransformer, t: dict) -> None:
    with torch.no_grad():
        features = model.forward_features(t["input"])
        torch.testing.assert_close(features, t["features"], rtol=0, atol=ATOL)
        pre_logits = model.forward_head(features, pre_logits=True)
        torch.testing.assert_close(pre_logits, t["pre_logits"], rtol=0, atol=ATOL)
        torch.testing.assert_close(model(t["input"]), t["logits"], rtol=0, atol=ATOL)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_load_timm_state_dict_reproduces_timm(path):
    timm_config, t = _fixture(path)
    model = VisionTransformer(ViTConfig.from_dict(timm_config)).eval()
    load_timm_state_dict(model, {k: v for k, v in t.items() if k.startswith("model.")})
    _assert_reproduces_timm(model, t)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_create_from_timm_infers_config_and_reproduces_timm(path):
    timm_config, t = _fixture(path)
    # the head count is the one thing the weights do not hold
    inferred = config_from_timm_state_dict(path, num_heads=timm_config["num_heads"])
    assert inferred == ViTConfig.from_dict(timm_config)
    model = create_from_timm(path, num_heads=timm_config["num_heads"])  # reads only the `model.` tensors
    assert not model.training
    _assert_reproduces_timm(model, t)


def test_gap_fixture_has_fc_norm_and_no_final_norm():
    _, t = _fixture(FIXTURES[1])
    cfg = config_from_timm_state_dict(t, num_heads=4)
    assert (cfg.global_pool, cfg.class_token) == ("avg", False)
    model = VisionTransformer(cfg)
    assert isinstance(model.norm, torch.nn.Identity) and isinstance(model.fc_norm, torch.nn.LayerNorm)

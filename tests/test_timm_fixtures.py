"""Checkpoints written by timm itself (tests/fixtures/README.md) reproduce timm's own outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitscope.vit import VisionTransformer, ViTConfig
from vitscope.weights.model_io import (
    config_from_timm_state_dict,
    create_from_timm,
    load_timm_state_dict,
    read_metadata,
)

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("timm_*.safetensors"))
# timm's float32 outputs are themselves up to 3e-5 RMS from the float64 values (ViT-Ti/16 file), and a CPU
# with other matmul kernels (AVX2 against AVX-512) sums in another order: so the largest difference may
# reach float32 rounding through two blocks, while the mean stays at rounding noise. Both are taken relative
# to the tensor's RMS. vitscope's float32 outputs measured at most 4.4e-5 (largest) and 1.8e-6 (mean) on a
# Zen 3 EPYC; each formula mismatch tried moves the features' mean far more: LayerNorm eps 1e-5 instead of
# 1e-6 gives 6.6e-6 to 2.4e-5, GELU's tanh approximation 1.0e-4 to 1.4e-4.
MAX_REL = 1e-4
MEAN_REL = 4e-6


def test_all_three_fixtures_are_present():
    names = ["timm_vit_28_cls", "timm_vit_28_gap", "timm_vit_tiny_patch16_224_depth2"]
    assert [p.stem for p in FIXTURES] == names


def _fixture(path: Path):
    return json.loads(read_metadata(path)["config"]), load_file(path)


def _assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} against timm's {tuple(want.shape)}"
    diff = (got.double() - want.double()).abs() / want.double().pow(2).mean().sqrt()
    assert diff.max() <= MAX_REL, f"{what}: largest difference {diff.max():.2e} of the RMS (allowed {MAX_REL:g})"
    assert diff.mean() <= MEAN_REL, f"{what}: mean difference {diff.mean():.2e} of the RMS (allowed {MEAN_REL:g})"


def _assert_reproduces_timm(model: VisionTransformer, t: dict) -> None:
    with torch.no_grad():
        features = model.forward_features(t["input"])
        _assert_matches(features, t["features"], "features")
        pre_logits = model.forward_head(features, pre_logits=True)
        _assert_matches(pre_logits, t["pre_logits"], "pre_logits")
        _assert_matches(model(t["input"]), t["logits"], "logits")


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

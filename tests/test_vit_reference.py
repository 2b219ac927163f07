"""Our ViT against transformers' ViTModel / ViTForImageClassification (the reference we did not write).

Random transformers weights are converted with `hf_to_vitscope` / `load_hf`; outputs must agree to
1e-5 in float32. Export goes the other way and is read back by `from_pretrained` itself.
"""

from __future__ import annotations

import re

import pytest
import torch

from vitscope.vit import VisionTransformer, ViTConfig
from vitscope.weights.hf import export_hf, hf_to_vitscope, load_hf

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
HFConfig, HFModel = transformers.ViTConfig, transformers.ViTModel
HFClassifier = transformers.ViTForImageClassification

ATOL = 1e-5
CONFIGS = {
    "28px_1ch_p4": dict(image_size=28, patch_size=4, num_channels=1, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, num_labels=10),
    "32px_3ch_p8_nobias_eps1e-6": dict(image_size=32, patch_size=8, num_channels=3, hidden_size=48,
                                       num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
                                       num_labels=7, qkv_bias=False, layer_norm_eps=1e-6),
    "224px_p16_depth2": dict(image_size=224, patch_size=16, num_channels=3, hidden_size=96,
                             num_hidden_layers=2, num_attention_heads=3, intermediate_size=384, num_labels=5),
}


def _perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Noise on every tensor, so that LayerNorm's ones/zeros or a zero bias cannot hide a mix-up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _hf(cls, name: str, **extra):
    torch.manual_seed(0)
    return _perturbed(cls(HFConfig(**CONFIGS[name], **extra)))


def _images(name: str, size: tuple[int, int] | None = None, batch: int = 2) -> torch.Tensor:
    c = CONFIGS[name]
    h, w = size or (c["image_size"], c["image_size"])
    return torch.randn(batch, c["num_channels"], h, w, generator=torch.Generator().manual_seed(1))


def _ours(hf_model) -> VisionTransformer:
    cfg, sd = hf_to_vitscope(hf_model.state_dict(), hf_model.config.to_dict())
    model = VisionTransformer(cfg)
    model.load_state_dict(sd, strict=True)
    return model.eval()


def _v4_names(sd: dict) -> dict:
    """transformers 4's key layout, written out here independently of the library's mapping."""
    renames = [
        (r"(^|\.)layers\.(\d+)\.", r"\1encoder.layer.\2."),
        (r"attention\.q_proj\.", "attention.attention.query."),
        (r"attention\.k_proj\.", "attention.attention.key."),
        (r"attention\.v_proj\.", "attention.attention.value."),
        (r"attention\.o_proj\.", "attention.output.dense."),
        (r"mlp\.fc1\.", "intermediate.dense."),
        (r"mlp\.fc2\.", "output.dense."),
    ]
    out = {}
    for k, v in sd.items():
        for pattern, repl in renames:
            k = re.sub(pattern, repl, k)
        out[k] = v
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_classifier_logits_and_hidden_state_match(name):
    hf = _hf(HFClassifier, name)
    ours = _ours(hf)
    assert ours.config.norm_eps == CONFIGS[name].get("layer_norm_eps", 1e-12)  # transformers' default
    x = _images(name)
    with torch.no_grad():
        ref_hidden = hf.vit(x).last_hidden_state
        torch.testing.assert_close(ours.forward_features(x), ref_hidden, rtol=0, atol=ATOL)
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["28px_1ch_p4", "32px_3ch_p8_nobias_eps1e-6"])
def test_vit_model_without_prefix_and_with_pooler(name):
    hf = _hf(HFModel, name)
    assert any(k.startswith("pooler.") for k in hf.state_dict())
    ours = _ours(hf)
    assert ours.config.num_classes == 0
    x = _images(name)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(x), hf(x).last_hidden_state, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["28px_1ch_p4", "32px_3ch_p8_nobias_eps1e-6"])
def test_transformers_4_key_layout_loads(name):
    hf = _hf(HFClassifier, name)
    sd = _v4_names(hf.state_dict())
    assert "vit.encoder.layer.0.attention.attention.query.weight" in sd
    assert "vit.encoder.layer.1.output.dense.weight" in sd
    ours = load_hf(sd, config=hf.config.to_dict())
    x = _images(name)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=ATOL)


def test_save_pretrained_folder_loads_without_transformers(tmp_path):
    hf = _hf(HFClassifier, "28px_1ch_p4")
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    x = _images("28px_1ch_p4")
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=ATOL)
    ours_file = load_hf(tmp_path / "model.safetensors")  # config.json found beside it
    with torch.no_grad():
        torch.testing.assert_close(ours_file(x), ours(x), rtol=0, atol=0)


@pytest.mark.parametrize("name,size", [("28px_1ch_p4", (40, 36)), ("28px_1ch_p4", (20, 20)),
                                       ("32px_3ch_p8_nobias_eps1e-6", (48, 48))])
def test_other_image_size_matches_interpolate_pos_encoding(name, size):
    hf = _hf(HFClassifier, name)
    ours = _ours(hf)
    x = _images(name, size)
    with torch.no_grad():
        ref = hf(x, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(ours(x), ref, rtol=0, atol=ATOL)
        # timm's resampling (antialiased bicubic) is a different function, so the converted model
        # must carry transformers' rule rather than pass by a looser tolerance
        timm_rule = VisionTransformer(ours.config, pos_embed_antialias=True)
        timm_rule.load_state_dict(ours.state_dict())
        assert (timm_rule.eval()(x) - ref).abs().max() > 1e-3


def test_hidden_act_other_than_exact_gelu_is_refused():
    hf = _hf(HFClassifier, "28px_1ch_p4", hidden_act="gelu_new")
    with pytest.raises(ValueError, match="hidden_act 'gelu_new' is not supported"):
        hf_to_vitscope(hf.state_dict(), hf.config.to_dict())


def test_unmappable_keys_are_refused():
    hf = _hf(HFClassifier, "28px_1ch_p4")
    sd = dict(hf.state_dict())
    sd["vit.embeddings.mask_token"] = torch.zeros(1, 1, 64)
    with pytest.raises(ValueError, match="cannot map: vit.embeddings.mask_token"):
        hf_to_vitscope(sd, hf.config.to_dict())


# -- export ---------------------------------------------------------------------------------------
def _our_model(**overrides) -> VisionTransformer:
    torch.manual_seed(3)
    cfg = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4,
               mlp_ratio=2.0)
    return _perturbed(VisionTransformer(ViTConfig(**{**cfg, **overrides})), seed=3)


@pytest.mark.parametrize("layout", ["checkpoint", "module"])
def test_export_round_trip_through_from_pretrained(tmp_path, layout):
    ours = _our_model(qkv_bias=False)
    export_hf(ours, tmp_path, labels=[f"class{i}" for i in range(10)], layout=layout)
    hf, info = HFClassifier.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hf.config.id2label[3] == "class3" and hf.config.layer_norm_eps == 1e-6
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits, ours(x), rtol=0, atol=ATOL)
        # at another size transformers resamples with plain bicubic: equal once ours uses that rule too
        y = torch.randn(2, 1, 36, 44)
        hf_rule = VisionTransformer(ours.config, pos_embed_antialias=False)
        hf_rule.load_state_dict(ours.state_dict())
        ref = hf(y, interpolate_pos_encoding=True).logits
        torch.testing.assert_close(ref, hf_rule.eval()(y), rtol=0, atol=ATOL)
    # the exported file holds exactly the names transformers itself would write or hold
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "model.safetensors"))
    if layout == "module":
        assert keys == set(HFClassifier(hf.config).state_dict())
    else:
        hf.save_pretrained(tmp_path / "reference")
        assert keys == set(load_file(tmp_path / "reference" / "model.safetensors"))


@pytest.mark.parametrize("overrides,why", [
    (dict(global_pool="avg", class_token=False), "class token and token pooling"),
    (dict(pos_embed="sincos2d"), "pos_embed='sincos2d'"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(init_values=1e-5), "layer scale"),
    (dict(stem=[(16, 2)]), "conv stem"),
])
def test_export_refuses_what_transformers_cannot_hold(tmp_path, overrides, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        export_hf(_our_model(**overrides), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()

"""The ViT's own behaviour: presets, pooling, the timm model API, dynamic size, errors, regularisation."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange

from vitscope import kernels
from vitscope.models import create_model, get_config, list_models
from vitscope.positional import resample_pos_embed
from vitscope.vit import VisionTransformer, ViTConfig

SMALL = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64, depth=2, num_heads=4,
             mlp_ratio=2.0)


def _model(seed: int = 0, **overrides) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(ViTConfig(**{**SMALL, **overrides}))
    with torch.no_grad():  # cls_token starts near zero and norms at 1/0: move them so mix-ups show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def _images(b: int = 2, c: int = 1, h: int = 28, w: int = 28) -> torch.Tensor:
    return torch.randn(b, c, h, w, generator=torch.Generator().manual_seed(1))


def _expected_params(cfg: ViTConfig) -> int:
    """Counted from the architecture, independently of the modules."""
    d, p, hidden = cfg.embed_dim, cfg.patch_size, int(cfg.embed_dim * cfg.mlp_ratio)
    h, w = (cfg.img_size, cfg.img_size) if isinstance(cfg.img_size, int) else cfg.img_size
    stem, c, stride = 0, cfg.in_chans, 1
    for out, s in cfg.stem:  # 3x3 conv without bias, then BatchNorm's weight and bias
        stem, c, stride = stem + c * out * 9 + 2 * out, out, stride * s
    k = p // stride
    embed = stem + c * k * k * d + d + (d if cfg.class_token else 0)
    if cfg.pos_embed == "learn":
        embed += ((h // p) * (w // p) + int(cfg.class_token)) * d
    block = (2 * 2 * d + 3 * d * d + (3 * d if cfg.qkv_bias else 0) + d * d + d
             + d * hidden + hidden + hidden * d + d)
    block += 2 * 2 * (d // cfg.num_heads) if cfg.qk_norm else 0
    block += 2 * d if cfg.init_values else 0
    return embed + cfg.depth * block + 2 * d + d * cfg.num_classes + cfg.num_classes


# -- presets --------------------------------------------------------------------------------------
def test_vit_base_patch16_224_has_the_papers_parameter_count():
    with torch.device("meta"):  # shapes only: no 350 MB of initialisation
        model = create_model("vit_base_patch16_224")
    assert model.num_params() == 86_567_656


@pytest.mark.parametrize("name", list_models())
def test_every_preset_builds_and_runs(name):
    cfg = get_config(name)
    with torch.device("meta"):
        full = VisionTransformer(cfg)
    assert full.num_params() == _expected_params(cfg)
    # the forward runs on a two-block copy, so the large presets stay cheap
    model = create_model(name, depth=min(cfg.depth, 2)).eval()
    h, w = (cfg.img_size, cfg.img_size) if isinstance(cfg.img_size, int) else cfg.img_size
    with torch.no_grad():
        out = model(_images(1, cfg.in_chans, h, w))
    assert out.shape == (1, cfg.num_classes) and torch.isfinite(out).all()


@pytest.mark.parametrize("overrides", [dict(qkv_bias=False, qk_norm=True, init_values=0.1),
                                       dict(class_token=False, global_pool="avg", pos_embed="sincos2d"),
                                       dict(stem=[(8, 2), (16, 2)], img_size=(28, 36), pos_embed="none")])
def test_parameter_count_of_options(overrides):
    cfg = ViTConfig(**{**SMALL, **overrides})
    assert VisionTransformer(cfg).num_params() == _expected_params(cfg)


def test_seed_vit_is_the_tutorials_model():
    cfg = get_config("seed_vit")
    assert (cfg.img_size, cfg.patch_size, cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.num_classes) == \
        (144, 4, 32, 6, 2, 37)
    assert create_model("seed_vit").blocks[0].mlp.fc1.out_features == 32


def test_config_dict_round_trip():
    cfg = ViTConfig(**{**SMALL, "img_size": (28, 32), "stem": [(16, 2)], "pos_embed_antialias": False})
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown ViTConfig fields"):
        ViTConfig.from_dict({"embed_dimm": 3})


# -- pooling and the head -------------------------------------------------------------------------
def test_gap_excludes_prefix_tokens():
    model = _model(global_pool="avg", class_token=True)  # a CLS token that average pooling must skip
    x = _images()
    with torch.no_grad():
        feats = model.forward_features(x)
        pooled = model.forward_head(feats, pre_logits=True)
        torch.testing.assert_close(pooled, model.fc_norm(feats[:, 1:].mean(dim=1)), rtol=0, atol=1e-6)
        changed = feats.clone()
        changed[:, 0] += 100.0
        torch.testing.assert_close(model.forward_head(changed, pre_logits=True), pooled, rtol=0, atol=0)
        assert not torch.allclose(pooled, model.fc_norm(feats.mean(dim=1)), atol=1e-3)


def test_forward_head_pre_logits_is_the_normed_class_token():
    model = _model()
    x = _images()
    with torch.no_grad():
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        torch.testing.assert_close(pre, feats[:, 0], rtol=0, atol=0)
        # model(x) runs the last block for the class token alone: the same logits up to float32 rounding
        torch.testing.assert_close(model.head(pre), model(x), rtol=0, atol=1e-5)
        # the features are the final norm of the last block's tokens
        tokens = model.embed(x)
        for block in model.blocks:
            tokens = block(tokens)
        torch.testing.assert_close(feats, model.norm(tokens), rtol=0, atol=0)


def test_forward_runs_the_last_block_for_the_class_token_with_the_same_logits_and_gradients():
    model = kernels.apply(_model()).train()  # dropout and drop-path are 0 in SMALL: both paths do the same sums
    x = _images(b=3)
    full = model.forward_head(model.forward_features(x))
    full.square().sum().backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert model._only_class_token_read()
    short = model(x)
    short.square().sum().backward()
    torch.testing.assert_close(short, full, rtol=0, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, full_grads[n], rtol=1e-4, atol=1e-4, msg=n)  # grads up to ~40


def test_the_last_block_runs_in_full_when_something_reads_its_tokens():
    model = kernels.apply(_model())
    x = _images()
    with torch.no_grad():
        expected = model.forward_head(model.forward_features(x))
        seen = []
        handle = model.blocks[-1].mlp.register_forward_hook(lambda m, i, out: seen.append(out.shape))
        out = model(x)
        handle.remove()
        assert seen == [(2, 50, SMALL["embed_dim"])]  # 49 patches and the class token
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, out: None)
        try:
            assert not model._only_class_token_read()
        finally:
            handle.remove()
        assert model._only_class_token_read()
        assert not kernels.apply(_model(global_pool="avg", class_token=False))._only_class_token_read()


def test_forward_intermediates_equal_manual_block_application():
    model = _model(depth=3)
    x = _images()
    with torch.no_grad():
        tokens, manual = model.embed(x), []
        for block in model.blocks:
            tokens = block(tokens)
            manual.append(tokens)
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.norm(tokens), rtol=0, atol=0)
        assert len(inter) == 3
        for got, want in zip(inter, manual):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        last_two = model.forward_intermediates(x, 2, norm=True, intermediates_only=True)
        for got, want in zip(last_two, manual[1:]):
            torch.testing.assert_close(got, model.norm(want), rtol=0, atol=0)
        maps = model.forward_intermediates(x, [0], output_fmt="NCHW", intermediates_only=True,
                                           return_prefix_tokens=True)
        grid, prefix = maps[0]
        assert grid.shape == (2, 64, 7, 7)
        torch.testing.assert_close(rearrange(grid, "b d h w -> b (h w) d"), manual[0][:, 1:], rtol=0, atol=0)
        torch.testing.assert_close(prefix, manual[0][:, :1], rtol=0, atol=0)


# -- image size -----------------------------------------------------------------------------------
def test_dynamic_non_square_size_uses_the_resampled_table():
    model = _model()
    x = _images(h=28, w=36)  # grid 7 x 9, trained on 7 x 7
    with torch.no_grad():
        pos = resample_pos_embed(model.pos_embed, (7, 9), (7, 7), num_prefix_tokens=1)
        assert pos.shape == (1, 1 + 63, 64)
        patches = rearrange(model.patch_embed.proj(x), "b d h w -> b (h w) d")
        want = torch.cat([model.cls_token.expand(2, -1, -1), patches], dim=1) + pos
        torch.testing.assert_close(model.embed(x), want, rtol=0, atol=1e-6)
        logits = model(x)
        assert logits.shape == (2, 10)
        torch.testing.assert_close(model(x), logits, rtol=0, atol=0)  # the cached table gives the same


def test_pos_embed_cache_does_not_break_training():
    model = _model()
    x = _images(h=32, w=32)
    with torch.no_grad():
        model(x)  # fills the cache for the 8 x 8 grid
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).square().mean().backward()
    assert model.pos_embed.grad is not None and model.pos_embed.grad.abs().sum() > 0
    opt.step()
    model.eval()
    fresh = VisionTransformer(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():  # the cached table of the old weights must not be reused
        torch.testing.assert_close(model(x), fresh(x), rtol=0, atol=0)


def test_wrong_image_size_and_channels_are_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="image size 30x28 is not a multiple of the patch size 4"):
        model(torch.randn(1, 1, 30, 28))
    with pytest.raises(ValueError, match="takes 1-channel images, got 3 channels"):
        model(torch.randn(1, 3, 28, 28))
    with pytest.raises(ValueError, match=r"expected images \(B, C, H, W\)"):
        model(torch.randn(1, 28, 28))


@pytest.mark.parametrize("pos_embed", ["sincos2d", "none"])
def test_fixed_and_absent_position_embeddings_run_at_any_size(pos_embed):
    model = _model(pos_embed=pos_embed)
    assert model.pos_embed is None
    with torch.no_grad():
        out = model(_images(h=20, w=32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


# -- regularisation, options, optimiser groups ----------------------------------------------------
def test_drop_path_and_dropout_only_in_training():
    rates = dict(drop_rate=0.3, pos_drop_rate=0.3, proj_drop_rate=0.3, attn_drop_rate=0.3, drop_path_rate=0.5)
    noisy, plain = _model(**rates), _model()
    plain.load_state_dict(noisy.state_dict())
    x = _images()
    with torch.no_grad():
        torch.testing.assert_close(noisy.eval()(x), plain(x), rtol=0, atol=0)
        noisy.train()
        torch.manual_seed(0)
        a = noisy(x)
        b = noisy(x)
        assert (a - b).abs().max() > 1e-3
        torch.testing.assert_close(plain.train()(x), plain.eval()(x), rtol=0, atol=0)


def test_layer_scale_zero_makes_blocks_identity():
    model = VisionTransformer(ViTConfig(**SMALL, init_values=1e-5)).eval()
    block = model.blocks[0]
    assert block.ls1.gamma.shape == (64,)
    tokens = torch.randn(2, 50, 64)
    with torch.no_grad():
        torch.testing.assert_close(block(tokens), tokens, rtol=0, atol=1e-2)  # near identity at 1e-5
        block.ls1.gamma.zero_()
        block.ls2.gamma.zero_()
        torch.testing.assert_close(block(tokens), tokens, rtol=0, atol=0)
        assert model(_images()).shape == (2, 10)


def test_qk_norm_makes_attention_invariant_to_query_scale():
    model = _model(qk_norm=True)
    attn = model.blocks[0].attn
    assert attn.q_norm.normalized_shape == (16,) and attn.k_norm.normalized_shape == (16,)
    x = _images()
    with torch.no_grad():
        before = model(x)
        attn.qkv.weight[:64] *= 10.0  # the query rows: LayerNorm over each head's query undoes the scale
        attn.qkv.bias[:64] *= 10.0
        torch.testing.assert_close(model(x), before, rtol=0, atol=1e-4)


def test_param_groups_put_norms_biases_and_tables_in_no_decay():
    model = _model(global_pool="avg", class_token=True, qk_norm=True, init_values=0.1)
    decay, no_decay = model.param_groups(weight_decay=0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert decayed | skipped == set(names.values()) and not decayed & skipped
    assert {"cls_token", "pos_embed", "fc_norm.weight", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias",
            "blocks.0.attn.q_norm.weight", "blocks.0.ls1.gamma", "head.bias"} <= skipped
    assert decayed == {n for n in names.values() if n.endswith("weight") and "norm" not in n and
                       n != "blocks.0.ls1.gamma"}
    assert "patch_embed.proj.weight" in decayed and "blocks.1.mlp.fc2.weight" in decayed


@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_conv_stem_runs_channels_last_with_the_kernels_and_gives_the_plain_layout_numbers(tmp_path, act):
    import torch.nn.functional as F

    from vitscope.weights.model_io import load_model, save_model

    model = kernels.apply(_model(stem=[(8, 1), (16, 2), (16, 2)], stem_act=act))
    pe = model.patch_embed
    cl = torch.channels_last
    assert all(m.weight.is_contiguous(memory_format=cl) for m in pe.modules() if isinstance(m, torch.nn.Conv2d))
    x = _images()
    h = x  # the stem by hand, every tensor in the default (B, C, H, W) layout
    for conv, bn in zip([m for m in pe.stem if isinstance(m, torch.nn.Conv2d)],
                        [m for m in pe.stem if isinstance(m, torch.nn.BatchNorm2d)]):
        h = F.conv2d(h, conv.weight.contiguous(), stride=conv.stride, padding=conv.padding)
        h = getattr(F, act)(F.batch_norm(h, bn.running_mean, bn.running_var, bn.weight, bn.bias, eps=bn.eps))
    h = F.conv2d(h, pe.proj.weight.contiguous(), pe.proj.bias, stride=pe.proj.stride)
    torch.testing.assert_close(pe(x), rearrange(h, "b d h w -> b (h w) d"), atol=1e-5, rtol=1e-5)
    # a checkpoint round trip keeps the numbers; the plain model keeps the default layout
    save_model(model, tmp_path / "m.safetensors")
    again = load_model(tmp_path / "m.safetensors").eval()
    assert again.patch_embed.proj.weight.is_contiguous()
    assert kernels.apply(again).patch_embed.proj.weight.is_contiguous(memory_format=cl)
    assert again.config.stem_act == act
    torch.testing.assert_close(again(x), model(x))


def test_stem_activation_is_checked_and_older_configs_mean_gelu():
    with pytest.raises(ValueError, match="stem_act must be one of"):
        ViTConfig(stem=[(8, 2)], stem_act="tanh")
    d = ViTConfig(stem=[(8, 2)]).to_dict()
    del d["stem_act"]  # a checkpoint written before the field existed
    assert ViTConfig.from_dict(d).stem_act == "gelu"


def test_reset_classifier_gives_a_fresh_head_that_checkpoints_record(tmp_path):
    """timm's fine-tuning call: a new head for another number of classes, or none (the pooled features)."""
    from vitscope.weights.model_io import load_model, save_model

    model = create_model("vit_tiny_patch4_28", depth=1).eval()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        pooled = model.forward_head(model.forward_features(x), pre_logits=True)
        model.reset_classifier(37)
        assert model.get_classifier().weight.shape == (37, 128) and model.config.num_classes == 37
        assert model.head.bias.abs().sum() == 0 and 0.01 < model.head.weight.std() < 0.03
        torch.testing.assert_close(model(x), model.head(pooled))
        save_model(model, tmp_path / "m.safetensors")
        assert load_model(tmp_path / "m.safetensors")(x).shape == (2, 37)
        model.reset_classifier(0)
        torch.testing.assert_close(model(x), pooled)
    with pytest.raises(ValueError, match="num_classes must be 0"):
        model.reset_classifier(-1)

"""The Muon + AdamW optimizer against torch.optim.Muon and AdamW run on the same tensors by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitscope.kernels import bf16
from vitscope.models import create_model
from vitscope.training.optim import MuonWithAdamW, build_optimizer, matrix_view, muon_param_names

HYBRID = {"img_size": 16, "patch_size": 4, "in_chans": 1, "embed_dim": 32, "depth": 1, "num_heads": 2,
          "num_classes": 5, "stem": [(8, 1), (16, 2), (16, 2)], "class_token": False, "global_pool": "avg",
          "pos_embed": "sincos2d"}


def test_the_hidden_matrices_go_to_muon_and_the_input_layer_head_and_tokens_do_not():
    hybrid = create_model("vit_fmnist_quick", **{k: HYBRID[k] for k in ("img_size", "stem", "num_classes")})
    assert muon_param_names(hybrid) == [
        "patch_embed.stem.3.weight", "patch_embed.stem.6.weight", "patch_embed.proj.weight",
        "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight",
        "blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight", "blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc2.weight"]
    plain = create_model("vit_tiny_patch4_28", depth=1)  # learned positions and a CLS token
    names = muon_param_names(plain)
    assert "patch_embed.proj.weight" not in names and "head.weight" not in names
    assert "pos_embed" not in names and "cls_token" not in names
    assert names == ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc1.weight",
                     "blocks.0.mlp.fc2.weight"]


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_matrix_view_shares_the_kernels_storage(channels_last):
    w = torch.randn(6, 4, 3, 3)
    if channels_last:
        w = w.contiguous(memory_format=torch.channels_last)
    view, cl = matrix_view(w)
    assert cl == channels_last and view.shape == (6, 36)
    view.mul_(0)
    assert (w == 0).all()
    with pytest.raises(ValueError, match="no 2-D view"):
        matrix_view(torch.randn(4, 3, 3, 6).permute(3, 0, 1, 2)[:, :, :2])


@pytest.mark.parametrize("channels_last", [False, True])
def test_three_steps_equal_torch_muon_on_the_flattened_kernels_and_adamw_on_the_rest(channels_last):
    torch.manual_seed(0)
    model = create_model("vit_fmnist_quick", **{k: HYBRID[k] for k in ("img_size", "stem", "num_classes")})
    if not channels_last:
        model.patch_embed.to(memory_format=torch.contiguous_format)
    ref = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    muon_names = set(muon_param_names(model))
    kw = dict(lr=1e-2, weight_decay=0.05, betas=(0.9, 0.99))
    opt = MuonWithAdamW(model, **kw)

    # the reference: torch's Muon on plain 2-D copies (kernels flattened as their memory runs), AdamW on the rest
    def flat(t: torch.Tensor) -> torch.Tensor:
        return (t.permute(0, 2, 3, 1) if t.ndim == 4 and channels_last else t).reshape(t.shape[0], -1)

    mats = {n: nn.Parameter(flat(ref[n]).clone()) for n in ref if n in muon_names}
    rest = {n: nn.Parameter(ref[n].clone()) for n in ref if n not in muon_names}
    ref_muon = torch.optim.Muon(list(mats.values()), lr=1e-2, weight_decay=0.05, adjust_lr_fn="match_rms_adamw")
    no_decay = {n for n in rest if rest[n].ndim <= 1 or n in model.no_weight_decay()}
    ref_adamw = torch.optim.AdamW([{"params": [rest[n] for n in rest if n not in no_decay], "weight_decay": 0.05},
                                   {"params": [rest[n] for n in rest if n in no_decay], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.99))
    steps = 3
    for _ in range(steps):
        loss = model(torch.randn(4, 1, 16, 16)).square().mean()
        opt.zero_grad()
        loss.backward()
        for n, p in model.named_parameters():
            (mats[n] if n in mats else rest[n]).grad = flat(p.grad) if n in mats else p.grad.clone()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
    for n, p in model.named_parameters():
        want = mats[n] if n in mats else rest[n]
        assert not torch.equal(p.detach(), ref[n]), f"{n} did not move"
        if n in mats:
            # torch's Newton-Schulz iteration is bfloat16: where bfloat16 matmuls are emulated (AVX2 CPUs) its
            # sums round in another order than vitscope's, so allow one bfloat16 rounding of each step's update
            update = 1e-2 * 0.2 * max(want.shape) ** 0.5
            atol = 1e-6 if bf16.native_matmul() else steps * update * 2**-7
            torch.testing.assert_close(flat(p.detach()), want.detach(), atol=atol, rtol=1e-5, msg=n)
        else:
            torch.testing.assert_close(p.detach(), want.detach(), atol=1e-6, rtol=1e-5, msg=n)


def test_state_dict_round_trip_and_a_foreign_state_is_a_clear_error():
    model = create_model("vit_tiny_patch4_28", depth=1)
    opt = build_optimizer("muon", model, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999), device=torch.device("cpu"))
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    opt.step()
    again = build_optimizer("muon", model, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999),
                            device=torch.device("cpu"))
    again.load_state_dict(opt.state_dict())
    for a, b in zip(opt.muon.state.values(), again.muon.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    adamw = build_optimizer("adamw", model, lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999),
                            device=torch.device("cpu"))
    with pytest.raises(ValueError, match="not saved by a Muon run"):
        again.load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="'adamw' or 'muon'"):
        build_optimizer("sgd", model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), device=torch.device("cpu"))

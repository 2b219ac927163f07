"""`vitscope bench`: the table, the JSON, the switch to PyTorch's ops, and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from vitscope.cli import bench, main
from vitscope.kernels import (
    fused_add_norm,
    fused_bn_gelu,
    fused_gelu,
    fused_layer_norm,
    fused_linear,
    fused_mlp,
    fused_residual,
    short_attention,
)

SMALL = ["--set", "depth=1", "--batch", "2", "--rounds", "1", "--steps", "1"]


def test_prints_the_kernels_and_both_variants(capsys):
    assert main(["bench", *SMALL]) == 0
    out = capsys.readouterr().out
    for part in ("vitscope's kernels here:", "attention, bfloat16", "train images/s", "infer images/s",
                 "vitscope attend", "F.scaled_dot_product_attention", "explicit softmax", "GELU, float32 (erfc)",
                 "linear products and MLP, float32"):
        assert part in out, part


def test_float32_kernel_states_follow_the_kernels_checks():
    from vitscope.kernels import linear_f32

    gelu, linear = dict(bench.float32_kernel_states()).values()
    assert gelu.startswith("on") == fused_gelu.fusable(torch.ones(2))
    assert linear.startswith("on") == (linear_f32.usable() and fused_linear.float32_available())
    assert all(s.startswith("on (avx2 build)") or s.startswith("off: ") for s in (gelu, linear))


def test_json_has_every_measurement(capsys):
    assert main(["bench", *SMALL, "--dtype", "float32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["dtype"] == "float32" and result["overrides"] == {"depth": 1}
    for mode in ("train", "infer"):
        assert set(result["images_per_s"][mode]) == {"vitscope", "PyTorch's ops"}
        assert all(v > 0 for v in result["images_per_s"][mode].values())
    assert result["attention_shape"] == {"batch": 2, "heads": 4, "tokens": 50, "head_dim": 32}
    assert set(result["attention_ms"]["forward+backward"]) == {"vitscope attend", "F.scaled_dot_product_attention",
                                                               "explicit softmax"}


def test_pytorch_ops_switches_every_part_off_and_back():
    owners = (short_attention, fused_mlp, fused_layer_norm, fused_residual, fused_add_norm, fused_gelu, fused_bn_gelu,
              fused_linear, fused_linear)
    before = [o.__dict__[n] for o, n in bench.SWITCHES]
    assert [o for o, _ in bench.SWITCHES] == list(owners)
    q = torch.randn(1, 2, 5, 32)
    with bench.pytorch_ops():
        assert not short_attention.usable(q, q, q)
        assert not fused_linear.fusable(q, torch.randn(4, 32))
        assert not fused_gelu.fusable(q.to(torch.bfloat16)) and not fused_gelu.fusable(q)
        assert not fused_linear.float32_fusable(q, torch.randn(4, 32))
    assert [o.__dict__[n] for o, n in bench.SWITCHES] == before


@pytest.mark.parametrize("args,message", [(["--model", "vit_nope"], "unknown model"),
                                          (["--batch", "0"], "positive"),
                                          (["--device", "tpu"], "choose cpu or cuda")])
def test_bad_arguments_say_what_to_do(args, message, capsys):
    assert main(["bench", *args]) != 0
    assert message in capsys.readouterr().err

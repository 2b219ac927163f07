"""`vitscope bench`: the table, the JSON, the switch to PyTorch's ops, and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from vitscope import kernels
from vitscope.cli import bench, main
from vitscope.kernels import fused_gelu

SMALL = ["--set", "depth=1", "--batch", "2", "--rounds", "1", "--steps", "1"]


def test_prints_the_kernels_and_both_variants(capsys):
    assert main(["bench", *SMALL]) == 0
    out = capsys.readouterr().out
    for part in ("vitscope's kernels here:", "attention, bfloat16 (amx)", "attention, float32 (avx2)",
                 "gelu, float32 (avx2)", "linear, bfloat16 (oneDNN)", "train images/s", "infer images/s",
                 "vitscope attend", "F.scaled_dot_product_attention", "explicit softmax"):
        assert part in out, part


def test_kernel_states_are_the_registrys():
    states = bench.kernel_states()
    assert len(states) == len(kernels.KERNELS)
    for (name, state), kernel in zip(states, kernels.KERNELS):
        why = kernels.why_not(kernel)
        assert state == ("on" if why is None else f"off: {why}"), name
    gelu = next(k for k in kernels.KERNELS if k.name == "gelu" and k.isa == "avx2")
    assert (kernels.why_not(gelu) is None) == fused_gelu.fusable(torch.ones(2))
    with kernels.disabled():
        assert all(state.startswith("off: turned off") for _, state in bench.kernel_states())


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


@pytest.mark.parametrize("args,message", [(["--model", "vit_nope"], "unknown model"),
                                          (["--batch", "0"], "positive"),
                                          (["--device", "tpu"], "choose cpu or cuda")])
def test_bad_arguments_say_what_to_do(args, message, capsys):
    assert main(["bench", *args]) != 0
    assert message in capsys.readouterr().err

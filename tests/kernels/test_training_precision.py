"""An end-to-end training run in the precision `amp=auto` picks on this CPU (bfloat16 where it multiplies
bfloat16 natively, else float32), with vitscope's kernels and without them: both reach the same loss."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("sklearn")

from vitscope.data.transforms import TrainTransform  # noqa: E402
from vitscope.kernels import bf16  # noqa: E402
from vitscope.training.config import TrainConfig  # noqa: E402
from vitscope.training.loop import train  # noqa: E402
from vitscope.training.options import ImageOptions  # noqa: E402

TINY = {"img_size": 8, "patch_size": 2, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0,
        "class_token": False, "global_pool": "avg"}


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r]


def test_auto_precision_trains_to_the_same_loss_with_and_without_the_kernels(tmp_path):
    half = bf16.native_matmul("cpu")
    runs = {}
    for kernels in (True, False):
        image = ImageOptions(model="vit_tiny_patch4_28", model_args=dict(TINY),
                             augment=TrainTransform(crop="none", flip=False))
        cfg = TrainConfig(image=image, dataset="digits", epochs=2, batch_size=64, lr=1e-2, warmup_epochs=0.3,
                          amp="auto", kernels=kernels, explain_images=0, threads=1)
        train(cfg, tmp_path / str(kernels), progress=False)
        runs[kernels] = _losses(tmp_path / str(kernels))
    fast, plain = runs[True], runs[False]
    assert len(fast) == len(plain) == 2
    assert fast[-1] < fast[0]  # it learns
    # float32: the same sums in another order; bfloat16: products rounded at other places
    torch.testing.assert_close(torch.tensor(fast), torch.tensor(plain), rtol=3e-2 if half else 2e-3, atol=0)
